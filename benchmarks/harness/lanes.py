"""Lanes: worker processes that hold one offline engine at a time, and the schedule that runs a
scenario's arms through them with as few engine starts on the critical path as possible.

Why processes: vLLM alone and the plugin cannot share a process (general plugins load once per
process, from ``VLLM_PLUGINS``), and a process is the unit whose GPU memory is surely freed. So a
scenario has a lane per environment (``alone``: ``VLLM_PLUGINS=""``, ``plugin``: the plugin
loaded), and each arm of a lane runs in a fresh process of that lane (later engines reuse the
machine's compile caches; an engine closed in a process leaves GPU memory held there).

The schedule (:func:`run_groups`): arms come in groups, measured in group order; the arms of a
group are measured together (a pair: vLLM alone and the plugin with the same draft, their
windows interleaved). A lane starts building its next arm as soon as it holds none, so engines of
later groups start beside the ones this group still waits for; nothing is measured while an
engine starts (its compilation and graph capture share the CPUs and the GPU);
with ``max_resident=1`` (GPU memory for one engine) only one engine exists at a time and every
arm is measured on its own. Before each build the budget decides whether the arm can still
finish; an arm that cannot is skipped and says so.

The protocol: the parent sends dicts over a pipe (``build``, ``call``, ``quit``) and
the lane answers each with a dict (``ok`` and the result, or ``error`` and a traceback). A lane
runs in its own session with its output in its log file; it is killed with its process group.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.harness import environment, host


class LaneError(RuntimeError):
    """The lane died or gave no answer in time (it is killed then)."""


class CallError(LaneError):
    """The lane answered with an error; it is alive and holds its engine."""


@dataclass
class Arm:
    """One engine configuration of a scenario."""

    name: str
    lane: str
    spec: dict  # what the lane's ``build`` gets (engine kwargs, speculative config, ...)
    measure_s: float = 60.0  # the measurements' expected time, for the budget
    status: str = "pending"
    info: dict = field(default_factory=dict)


def lane_main(conn, env: dict, log_path: str, trace_dir: str, device: str) -> None:
    """The lane process: environment first (before vLLM is imported), then serve requests."""
    os.setsid()
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    os.environ.clear()
    os.environ.update(env)
    engine, lane_cpus = None, None
    while True:
        try:
            op = conn.recv()
        except EOFError:
            break
        if op["op"] == "quit":
            break
        try:
            if op["op"] == "build":
                if engine is not None:
                    engine.close()
                    engine = None
                from benchmarks.harness.offline import OfflineEngine

                if lane_cpus is None and env.get(host.LANE_CPUS):
                    lane_cpus = host.pin(env[host.LANE_CPUS])  # before vLLM starts its threads
                engine = OfflineEngine(op["arm"], Path(trace_dir), device)
                engine.info["lane_cpus"] = lane_cpus or "all"
                reply = {"ok": True, **engine.info}
            elif op["op"] == "call":
                module, _, name = op["fn"].partition(":")
                fn = getattr(importlib.import_module(module), name)
                reply = {"ok": True, "result": fn(engine, **op.get("args", {}))}
            else:
                reply = {"ok": False, "error": f"unknown lane op {op['op']!r}"}
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            reply = {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:2000]}",
                     "traceback": traceback.format_exc()[-4000:]}  # fmt: skip
            print(reply["traceback"], flush=True)
        conn.send(reply)


class Lane:
    """The parent's handle of one lane process."""

    def __init__(self, name: str, env: dict, out: Path, trace_root: Path, device: str):
        self.name, self.env, self.device = name, env, device
        self.log_path = out / "logs" / f"lane-{name}.log"
        self.trace_dir = trace_root / name
        self.proc = self.conn = None
        self.held: Arm | None = None  # the arm whose engine the lane holds or builds
        self.building = False
        self.log_offset = 0

    def _ensure(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            return
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        parent, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=lane_main,
            args=(child, self.env, str(self.log_path), str(self.trace_dir), self.device),
            name=f"lane-{self.name}",
        )
        self.proc.start()
        self.conn = parent

    def send(self, op: dict) -> None:
        self._ensure()
        self.conn.send(op)

    def ready(self) -> bool:
        return self.conn is not None and self.conn.poll(0)

    def receive(self, timeout: float) -> dict:
        """The lane's answer; :class:`LaneError` when it died or took longer than ``timeout``
        (the lane is killed then)."""
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            if self.conn.poll(min(1.0, max(0.0, deadline - time.monotonic()))):
                try:
                    return self.conn.recv()
                except EOFError:
                    pass
            if not self.proc.is_alive():
                self.kill()
                raise LaneError(f"lane {self.name} exited (code {self.proc.exitcode}); see "
                                f"{self.log_path}")  # fmt: skip
            if time.monotonic() >= deadline:
                self.kill()
                raise LaneError(f"lane {self.name} gave no answer in {timeout:.0f} s (killed)")

    def request(self, op: dict, timeout: float) -> dict:
        self.send(op)
        return self.receive(timeout)

    def call(self, fn: str, timeout: float, **args) -> dict:
        """Run ``module:function(engine, **args)`` in the lane; its result. :class:`CallError`
        when it raised there, :class:`LaneError` when the lane died or ran out of time."""
        reply = self.request({"op": "call", "fn": fn, "args": args}, timeout)
        if not reply.get("ok"):
            raise CallError(reply.get("error", "unknown error"))
        return reply["result"]

    def log_since(self) -> str:
        try:
            with open(self.log_path, errors="replace") as fh:
                fh.seek(self.log_offset)
                return fh.read()
        except OSError:
            return ""

    def mark_log(self) -> None:
        try:
            self.log_offset = self.log_path.stat().st_size
        except OSError:
            self.log_offset = 0

    def kill(self) -> None:
        if self.proc is not None and self.proc.pid:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.proc.join(10)
        self.proc = self.conn = None
        self.held, self.building = None, False

    def close(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            try:
                self.conn.send({"op": "quit"})
                self.proc.join(30)
            except (OSError, EOFError):
                pass
        self.kill()


class Lanes:
    """A scenario's lanes by name, stopped together."""

    def __init__(self, envs: dict[str, dict], out: Path, trace_root: Path, device: str):
        self.by_name = {n: Lane(n, env, out, trace_root, device) for n, env in envs.items()}

    def __getitem__(self, name: str) -> Lane:
        return self.by_name[name]

    def __iter__(self):
        return iter(self.by_name.values())

    def close(self) -> None:
        for lane in self:
            lane.close()

    def __enter__(self) -> Lanes:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ------------------------------------------------------------------------------------------
# the schedule


ARM_MEASUREMENTS = "an arm's measurements"  # the budget's label for them


def run_groups(groups: list[list[Arm]], lanes: Lanes, budget, measure, record, max_resident: int):
    """Build and measure ``groups`` in order (see the module doc). ``measure(arms)`` measures a
    group's built arms; ``record(arm)`` is called whenever an arm's status changes."""
    if max_resident < 2:
        groups = [[a] for g in groups for a in g]
    order = {a.name: i for i, a in enumerate(a for g in groups for a in g)}
    queues = {lane.name: [a for g in groups for a in g if a.lane == lane.name] for lane in lanes}
    done: set[str] = set()
    try:
        for group in groups:
            while True:
                _end_done(lanes, done)
                _start_builds(lanes, queues, order, budget, record, max_resident, done)
                # measure only once no engine is starting: a start compiles and captures on the
                # same CPUs and GPU the measurement uses
                if not any(lane.building for lane in lanes):
                    break
                _wait_for_build(lanes, budget, record, done)
            ready = [a for a in group if a.status == "ready"]
            if ready:
                began = time.monotonic()
                measure(ready)
                # later arms are judged by what an arm's measurements took here
                budget.record_work(ARM_MEASUREMENTS, (time.monotonic() - began) / len(ready))
            for a in ready:
                if a.status == "ready":
                    a.status = "ok"
                record(a)
                done.add(a.name)
    finally:
        lanes.close()


def _end_done(lanes: Lanes, done: set) -> None:
    """End the lane processes whose arm is measured. Closing an engine leaves part of its GPU
    memory held in the process (seen on an H100: ~22 GiB of an NVFP4 Lightning engine, and the
    next engine did not fit), so a lane's next arm starts in a fresh process."""
    for lane in lanes:
        if lane.held is not None and not lane.building and lane.held.name in done:
            lane.close()


def _start_builds(lanes, queues, order, budget, record, max_resident, done) -> None:
    while True:
        resident = sum(lane.held is not None for lane in lanes)
        heads = []
        for lane in lanes:
            queue = queues[lane.name]
            while queue and queue[0].name in done:
                queue.pop(0)
            if lane.held is None and queue:
                heads.append((order[queue[0].name], lane, queue))
        if not heads or resident >= max_resident:
            return
        _, lane, queue = min(heads, key=lambda h: h[0])
        arm = queue.pop(0)
        need = budget.start_estimate() + budget.work_estimate(ARM_MEASUREMENTS, arm.measure_s)
        if not budget.fits(need):
            arm.status = budget.skipped(f"{arm.name} (engine start and measurements)", need)
            print(f"[{budget.elapsed():5.0f}s] {arm.name}: {arm.status}", flush=True)
            done.add(arm.name)
            record(arm)
            continue
        print(f"[{budget.elapsed():5.0f}s] {arm.name}: starting its engine in lane {lane.name} "
              f"(log {lane.log_path})", flush=True)  # fmt: skip
        lane.mark_log()
        lane.send({"op": "build", "arm": arm.spec})
        lane.held, lane.building = arm, True
        arm.info["build_started"] = time.monotonic()


def _wait_for_build(lanes: Lanes, budget, record, done: set) -> None:
    """Until one building lane answers (or is out of time)."""
    while True:
        for lane in lanes:
            if not lane.building:
                continue
            arm = lane.held
            started = arm.info.get("build_started", time.monotonic())
            waited = time.monotonic() - started
            # past the budget's end by a minute (not: past what was left when it started; a
            # start begins only inside the budget, so it has then waited over a minute too)
            overdue = budget.remaining() < -60.0
            if not lane.ready() and not overdue and lane.proc.is_alive():
                continue
            try:
                reply = lane.receive(timeout=5.0)
            except LaneError as exc:
                reply = {"ok": False, "error": str(exc)}
                if overdue:  # a start that ran past the budget is stopped, and says so
                    reply["error"] = (
                        f"engine start stopped after {waited:.0f} s, past --budget-s (a start "
                        f"was estimated at ~{budget.start_estimate():.0f} s; --first-start-s "
                        f"sets the estimate before one is seen): {exc}"
                    )
            lane.building = False
            arm.info.pop("build_started", None)
            arm.info.update({k: v for k, v in reply.items() if k not in ("ok",)})
            arm.info["log"] = environment.engine_log_lines(lane.log_since())
            if reply.get("ok"):
                arm.status = "ready"
                budget.record_start(reply.get("startup_s", 0.0))
                print(f"[{budget.elapsed():5.0f}s] {arm.name}: engine up in "
                      f"{reply.get('startup_s')} s", flush=True)  # fmt: skip
            else:
                arm.status = f"error: {reply.get('error')}"[:600]
                done.add(arm.name)
                if lane.proc is None or not lane.proc.is_alive():
                    lane.held = None
                print(f"[{budget.elapsed():5.0f}s] {arm.name}: engine failed: "
                      f"{str(reply.get('error'))[:400]}", flush=True)  # fmt: skip
            record(arm)
            return
        time.sleep(0.2)
