"""An offline engine in this process, driven one step at a time, and its measurement windows.

The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core, its executor
``uni`` and the worker live in this process), so the harness calls ``llm.llm_engine.step()``
itself and reaches the model runner (``instrument``). A window of concurrency B:

1. B fresh requests (random ``--input-len`` prompts, greedy, ``ignore_eos``, ``max_tokens`` past
   the window, one seed each: the same prompts and seeds in every arm, so synthetic acceptance,
   which vLLM draws from the request's seed and the position, accepts the same drafts everywhere);
2. steps until every request has its first token, then ``--warmup-steps`` decode steps;
3. the window: ``--steps`` calls of ``step()``. The step counter counts the runner's
   ``execute_model`` calls and their batch shapes: a window is ``decode_only`` when every step
   ran exactly the B requests with ``k + 1`` tokens each and none was new. With async scheduling
   (vLLM's default) ``step()`` schedules and launches one batch and returns the outputs of the
   one before, so over many steps each call is one engine step;
4. the requests are aborted and the engine drained.

Every window also records the pauses of this process's garbage collector inside it (the engine
core runs here: a collection stops the step loop while the GPU drains what was launched):
``gc_ms_per_step`` and the collections by generation; the spread of its ``step()`` calls
(``step_call_ms``: median, 90th percentile, longest); and its host use (``host``: the main
thread's and the process's CPU time per step, the thread's context switches, the CPUs it ran on;
``harness/host.py``); with ``BENCH_HOST_PROFILE`` set (``speed --host-profile``), a wall window
also records on what the host's step time went (``host_profile``: py-spy's samples by function,
``harness/hostprof.py``).

Kinds of window: ``wall`` (no profiler: wall time, tokens, spec-decode counters), ``busy`` (vLLM's
torch profiler with CUDA activity only, ``llm.start_profile()`` / ``stop_profile()`` around the
window, with a device synchronize on both sides so the trace holds exactly the window's steps:
GPU-busy = the union of device activity) and ``split`` (the same with CPU activity too and the
phase ranges of ``instrument.phase_ranges``: GPU time by part, through the kernels' correlation
ids).
"""

from __future__ import annotations

import contextlib
import gc
import random
import time
import zlib
from pathlib import Path

from benchmarks.harness import arms, host, hostprof, instrument, trace

MAX_PREFILL_STEPS = 256
PROFILED = ("busy", "split", "draft")
"""Profiled kinds: ``busy`` with CUDA activity only, the others with CPU activity too."""


def request_seed(kind: str, conc: int, repeat: int, index: int) -> int:
    """The seed of one request: the same in every arm and engine for the same window."""
    return zlib.crc32(f"{kind}/{conc}/{repeat}/{index}".encode())


def prompt_ids(vocab: int, length: int, kind: str, conc: int, repeat: int, index: int) -> list:
    """One request's prompt: random tokens, the same in every arm for the same window."""
    rng = random.Random(f"prompt/{kind}/{conc}/{repeat}/{index}")
    return [rng.randrange(10, vocab) for _ in range(length)]


def max_tokens_for(num_spec: int, warmup_steps: int, steps: int) -> int:
    """Enough tokens that no request ends inside the window, whatever it accepts."""
    return (warmup_steps + steps + 8) * (num_spec + 1) + 16


SLOW_CALL = 1.25  # a step() call this many times the window's median is a slow one
SLOW_CALLS_KEPT = 32


def call_spread(seconds: list[float]) -> dict | None:
    """Median, 90th percentile and longest of a window's ``step()`` calls, in ms: a wall time
    above GPU-busy from a few long calls (a stall) or from every call (steady host work); and
    where the slow calls fell (``slow_at``: their indices in the window, the first 32), which
    shows a period if they have one."""
    if not seconds:
        return None
    ms = sorted(v * 1e3 for v in seconds)
    p50 = ms[len(ms) // 2]
    slow = [i for i, v in enumerate(seconds) if v * 1e3 > SLOW_CALL * p50]
    return {"p50": p50, "p90": ms[min(len(ms) - 1, (9 * len(ms)) // 10)], "max": ms[-1],
            "slow": len(slow), "slow_at": slow[:SLOW_CALLS_KEPT]}  # fmt: skip


class GcPauses:
    """While active (``with``): the time this process spends in garbage collections and their
    count by generation (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.by_generation = [0, 0, 0]
        self._began: float | None = None

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            self.seconds += time.perf_counter() - self._began
            self.by_generation[min(int(info.get("generation", 2)), 2)] += 1
            self._began = None

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)


class OfflineEngine:
    """One ``vllm.LLM`` for one arm (``arm``: ``engine`` kwargs, ``speculative`` config or None,
    ``num_spec``), with the profiler configured and the step counter on."""

    def __init__(self, arm: dict, trace_dir: Path, device: str):
        from vllm import LLM

        self.arm, self.device = arm, device
        self.trace_dir = Path(trace_dir)
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        self.num_spec = arm.get("num_spec", 0)
        kwargs = dict(arm["engine"])
        kwargs["profiler_config"] = {
            "profiler": "torch",
            "torch_profiler_dir": str(self.trace_dir),
            "torch_profiler_activities": ["CUDA"] if device == "cuda" else ["CPU"],
            "torch_profiler_with_stack": False,
            "torch_profiler_use_gzip": False,
            "torch_profiler_dump_cuda_time_total": False,
        }
        if arm.get("speculative"):
            from vllm.config import LoadConfig

            spec = dict(arm["speculative"])
            spec["draft_load_config"] = LoadConfig(load_format="auto")
            kwargs["speculative_config"] = spec
        t0 = time.perf_counter()
        self.llm = LLM(**kwargs)
        self.startup_s = time.perf_counter() - t0
        self.runner = instrument.runner_of(self.llm)
        self.counter = instrument.StepCounter(self.runner)
        self.info = {"startup_s": round(self.startup_s, 1), "runner": type(self.runner).__module__}
        model = getattr(self.runner, "model", None)
        if model is not None and device == "cuda":
            from benchmarks.harness.models import routing_spread

            self.info["routing"] = routing_spread(model)
        self.vocab = self.llm.llm_engine.model_config.get_vocab_size()

    # --------------------------------------------------------------------------------------

    def _step(self, counts: dict) -> None:
        for out in self.llm.llm_engine.step():
            counts[out.request_id] = len(out.outputs[0].token_ids)
            if out.finished and out.request_id in self._ours:
                self._finished.add(out.request_id)

    def _add(self, kind: str, conc: int, repeat: int, input_len: int, max_tokens: int) -> list:
        from vllm import SamplingParams

        ids = []
        for i in range(conc):
            rid = f"{kind}-c{conc}-r{repeat}-{i}-{time.monotonic_ns()}"
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=0.0,
                ignore_eos=True,
                detokenize=False,
                seed=request_seed(kind, conc, repeat, i),
            )
            prompt = {"prompt_token_ids": prompt_ids(self.vocab, input_len, kind, conc, repeat, i)}
            self.llm.llm_engine.add_request(rid, prompt, params)
            ids.append(rid)
        return ids

    def _drain(self, ids: list) -> None:
        engine = self.llm.llm_engine
        engine.abort_request(ids)
        for _ in range(MAX_PREFILL_STEPS):
            if not engine.has_unfinished_requests():
                return
            engine.step()
        raise RuntimeError("the engine still has requests after aborting the window's")

    def _sync(self) -> None:
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()

    def window(self, kind: str, conc: int, repeat: int, steps: int, input_len: int,
               warmup_steps: int, ranges=None, analyse=None) -> dict:  # fmt: skip
        """One window (see the module doc); its measurements. A profiled window with CPU activity
        may bring its own ``ranges`` (a context manager factory; ``split``: the runner's phases)
        and ``analyse(events, steps) -> dict`` of the trace (``split``: GPU time by phase)."""
        max_tokens = max_tokens_for(self.num_spec, warmup_steps, steps)
        ids = self._add(kind, conc, repeat, input_len, max_tokens)
        self._ours, self._finished = set(ids), set()
        counts: dict = {}
        try:
            self._past_prefill(counts, conc, warmup_steps)
            context = input_len + sum(counts.values()) / max(1, len(counts))
            rate = hostprof.rate_from_env() if kind not in PROFILED else None
            path = self.trace_dir / f"pyspy-{kind}-c{conc}-r{repeat}.txt"
            sampler = hostprof.Sampler(path, rate) if rate else None
            if kind in PROFILED:
                measured, trace_info = self._profiled(kind, counts, steps, ranges)
            else:
                with sampler or contextlib.nullcontext():
                    measured, trace_info = self._timed(counts, steps), {}
        finally:
            self._drain(ids)
        counted, shapes = measured["steps"], measured["shapes"]
        k = arms.k_at(self.arm.get("speculative"), self.num_spec, conc)  # a schedule's k at conc
        expected = f"{conc}x{conc * (k + 1)}"
        wall, tokens, spec = measured["wall_s"], measured["tokens"], measured["spec"]
        out = {
            "kind": kind, "conc": conc, "repeat": repeat, "steps": counted, "step_calls": steps,
            "wall_s": wall, "tokens": tokens, "context_at_start": round(context, 1),
            "ms_per_step": wall * 1e3 / counted if counted else None,
            "tokens_per_step": tokens / counted if counted else None,
            "tok_s": tokens / wall if wall > 0 else None,
            "acceptance_length": spec.mean_acceptance_length,
            "per_position_acceptance": spec.per_position_acceptance,
            "shapes": shapes, "decode_only": set(shapes) == {expected},
            "expected_shape": expected, "finished_inside": len(self._finished),
            "gc_ms_per_step": measured["gc_s"] * 1e3 / counted if counted else None,
            "gc_collections": measured["gc_collections"],
            "step_call_ms": measured["step_call_ms"], "host": measured["host"],
        }  # fmt: skip
        if sampler is not None:
            out["host_profile"] = sampler.profile(counted)
        if trace_info:
            out.update(self._read_trace(kind, trace_info, counted, analyse))
        return out

    def _past_prefill(self, counts: dict, conc: int, warmup_steps: int) -> None:
        """Steps until every request has its first token, then ``warmup_steps`` more."""
        for _ in range(MAX_PREFILL_STEPS):
            if len(counts) >= conc and min(counts.values()) >= 1:
                break
            self._step(counts)
        else:
            raise RuntimeError(f"{conc} requests not past their prefill after "
                               f"{MAX_PREFILL_STEPS} steps")  # fmt: skip
        for _ in range(warmup_steps):
            self._step(counts)

    def _timed(self, counts: dict, steps: int, sync: bool = False) -> dict:
        """``steps`` engine steps: wall time, the runner's step count and batch shapes, tokens,
        spec-decode counters."""
        from vllm_nemotron_spec.runs import read_spec_counters

        spec0, tokens0 = read_spec_counters(self.llm), sum(counts.values())
        mark = self.counter.mark()
        calls = []
        with GcPauses() as pauses, host.HostUse() as used:
            t0 = time.perf_counter()
            for i in range(steps):
                began = time.perf_counter()
                self._step(counts)
                calls.append(time.perf_counter() - began)
                if i % 16 == 15:
                    used.sample()
            if sync:
                self._sync()
            wall = time.perf_counter() - t0
        counted, shapes = self.counter.since(mark)
        return {
            "wall_s": wall,
            "steps": counted,
            "shapes": shapes,
            "tokens": sum(counts.values()) - tokens0,
            "spec": read_spec_counters(self.llm).minus(spec0),
            "gc_s": pauses.seconds,
            "gc_collections": list(pauses.by_generation),
            "step_call_ms": call_spread(calls),
            "host": used.per_step(counted),
        }

    def _profiled(self, kind: str, counts: dict, steps: int, ranges) -> tuple[dict, dict]:
        """A timed window inside vLLM's profiler (device synchronized on both sides, so the
        trace holds exactly its steps), with the phase ranges for ``split``."""
        self._sync()
        info = {"started": time.time()}
        if ranges is None and kind == "split":
            ranges = lambda: instrument.phase_ranges(self.runner, self.num_spec > 0)  # noqa: E731
        with contextlib.ExitStack() as stack:
            if ranges is not None:
                info["ranges"] = stack.enter_context(ranges())
            self._start_profile(kind)
            try:
                measured = self._timed(counts, steps, sync=True)
            finally:
                self.llm.stop_profile()
        return measured, info

    def _start_profile(self, kind: str) -> None:
        """``llm.start_profile`` with CUDA activity (``busy``) or CPU and CUDA activity (the
        others: the ranges are CPU events), the latter through ``profiler_kwargs``."""
        if kind != "busy" and self.device == "cuda":
            import torch

            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            self.llm.start_profile(f"{kind}", profiler_kwargs={"activities": activities})
        else:
            self.llm.start_profile(f"{kind}")

    def _read_trace(self, kind: str, info: dict, steps: int, analyse=None) -> dict:
        path = trace.newest_trace(self.trace_dir, after=info["started"] - 1)
        if path is None:
            raise RuntimeError(f"no profiler trace under {self.trace_dir} after the {kind} window")
        events = trace.load_events(path)
        path.unlink()
        busy, what = trace.busy_us(events)
        out = {
            "busy_ms_per_step": busy / 1e3 / steps if steps else None,
            "busy_counted": what,
            "span_ms": trace.span_us(events) / 1e3,
            "device_events": len(trace.device_events(events)),
        }
        if analyse is not None:
            out.update(analyse(events, steps))
            out["ranges"] = info.get("ranges")
        elif kind == "split":
            split = trace.by_priority(trace.assign_ranges(events), instrument.PRIORITY)
            out["parts_ms_per_step"] = {k: v / 1e3 / steps for k, v in split["us"].items()}
            out["parts_kernel_ms_per_step"] = {
                k: v / 1e3 / steps for k, v in split["kernel_us"].items()
            }
            out["parts_count_per_step"] = {k: v / steps for k, v in split["count"].items()}
            out["ranges"] = info.get("ranges")
            out["top_kernels"] = {
                part: [[name, round(us / 1e3 / steps, 4)] for name, us in
                       sorted(kernels.items(), key=lambda kv: -kv[1])[:15]]
                for part, kernels in split["top"].items()
            }  # fmt: skip
        return out

    def close(self) -> None:
        try:
            self.llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001 - freeing what can be freed matters more
            pass
        del self.llm, self.runner
        gc.collect()
        if self.device == "cuda":
            import torch

            torch.cuda.empty_cache()


def run_window(engine: OfflineEngine, **args) -> dict:
    """A lane ``call``: one window of the lane's engine (:meth:`OfflineEngine.window`)."""
    if engine is None:
        raise RuntimeError("the lane holds no engine")
    return engine.window(**args)
