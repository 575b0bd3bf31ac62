"""Where a wall window's host time goes: py-spy sampling the lane's own process while the window's
steps run (``speed --host-profile``), summarised per engine step by Python function.

A window's ``host`` columns say how much CPU the engine thread used a step; at one request on
some machines that is the whole wall time (the step waits on the host, not on the GPU), and
this says on what. py-spy (``pip install py-spy``; in the GPU bundle of ``docs/DEVELOPING.md``)
samples from another process without pausing the engine (``--nonblocking``), so the window's
timing stands. Only samples inside the timed steps count (below :data:`WINDOW_FRAME`), so
the prefill and warm-up steps around the window do not. Sampling needs the right to read the
lane's memory (root, or ``ptrace_scope`` 0); where py-spy cannot attach, the window records why
and is measured as usual.
"""

from __future__ import annotations

import collections
import os
import re
import select
import shutil
import signal
import subprocess
import time
from pathlib import Path

ENV = "BENCH_HOST_PROFILE"  # samples a second, set in a lane's environment by --host-profile
DEFAULT_RATE = 400
WINDOW_FRAME = "OfflineEngine._timed ("  # the harness's timed loop (harness/offline.py)
STEP_FRAME = "LLMEngine.step ("  # vLLM's engine step, the unit of the report
KEPT = 40  # functions kept per window (by inclusive samples)
WIDE = 0.5  # a function holding this share of the step or more is a wrapper, not an answer
ATTACH_TIMEOUT_S = 30.0  # py-spy's attach message, at most this late

_FRAME = re.compile(r"^(?P<name>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def rate_from_env() -> int | None:
    value = os.environ.get(ENV, "")
    return int(value) if value else None


def frame_name(frame: str) -> str:
    """``func (path/to/pkg/file.py:123)`` -> ``func (pkg/file.py)``: one name per function."""
    m = _FRAME.match(frame)
    if not m:
        return frame
    return f"{m['name']} ({'/'.join(m['file'].split('/')[-2:])})"


def count_samples(raw: str) -> dict:
    """py-spy's raw output (``stack count`` lines, frames ``;``-joined, outermost first) -> the
    samples inside the timed window, inside ``LLMEngine.step`` and, per function below the step,
    inclusive (each function once a sample) and self (the innermost frame) counts."""
    window = step = 0
    inclusive: collections.Counter = collections.Counter()
    own: collections.Counter = collections.Counter()
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        if not any(f.startswith(WINDOW_FRAME) for f in frames):
            continue
        window += int(n)
        at = next((i for i, f in enumerate(frames) if f.startswith(STEP_FRAME)), None)
        if at is None:
            continue
        step += int(n)
        below = [frame_name(f) for f in frames[at + 1 :]]
        for name in set(below):
            inclusive[name] += int(n)
        if below:
            own[below[-1]] += int(n)
    return {"window": window, "step": step, "inclusive": dict(inclusive.most_common(KEPT)),
            "self": dict(own.most_common(KEPT // 2))}  # fmt: skip


def merge(profiles: list[dict]) -> dict | None:
    """A cell's windows together: samples, steps and inclusive counts summed (each window's
    ``host_profile``; the report reads no self counts)."""
    good = [p for p in profiles if p and not p.get("error")]
    if not good:
        return None
    total = {"window": 0, "step": 0, "steps": 0, "inclusive": collections.Counter(),
             "rate": good[0]["rate"]}  # fmt: skip
    for p in good:
        for key in ("window", "step", "steps"):
            total[key] += p[key]
        total["inclusive"].update(p["inclusive"])
    return total


def ms_per_step(profile: dict, samples: int) -> float:
    return samples * 1e3 / profile["rate"] / max(profile["steps"], 1)


def top_functions(profile: dict, n: int = 6) -> list[tuple[str, float]]:
    """The functions holding the most of a step, wrappers (:data:`WIDE` of it or more) left out,
    in ms per step."""
    wide = WIDE * profile["step"]
    named = [(k, v) for k, v in profile["inclusive"].items() if v < wide]
    named.sort(key=lambda kv: -kv[1])
    return [(k, ms_per_step(profile, v)) for k, v in named[:n]]


def describe(profile: dict, n: int = 3) -> str:
    """One line: ms per step inside ``step()`` and the top functions."""
    top = "; ".join(f"{k.split(' (')[0]} {v:.2f}" for k, v in top_functions(profile, n))
    return f"{ms_per_step(profile, profile['step']):.2f} ms/step sampled in step(): {top}"


_gave_up = ""  # why py-spy could not sample this process, once it could not


class Sampler:
    """While active (``with``): py-spy records this process into ``path``; :attr:`error` says
    why not where it could not."""

    def __init__(self, path: Path, rate: int):
        self.path, self.rate = Path(path), rate
        self.error: str | None = None
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Sampler:
        global _gave_up
        exe = shutil.which("py-spy")
        if exe is None:
            self.error = "py-spy not found on PATH (pip install py-spy)"
            return self
        if _gave_up:  # each failed attach costs up to ATTACH_TIMEOUT_S of the device's time
            self.error = f"{_gave_up} (in an earlier window of this process; not tried again)"
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [exe, "record", "--pid", str(os.getpid()), "--rate", str(self.rate),
               "--nonblocking", "--idle", "--format", "raw", "-o", str(self.path)]  # fmt: skip
        # py-spy prints "Sampling process ..." on STDOUT once attached, its errors on stderr;
        # unbuffered, so that select() sees every byte not yet read
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     bufsize=0)  # fmt: skip
        said = self._until_sampling()
        if said is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait(timeout=30)
            said = (said + self.proc.stdout.read().decode(errors="replace")).strip()[:300]
            self.error = _gave_up = (
                f"py-spy could not sample: {said or f'nothing within {ATTACH_TIMEOUT_S} s'}"
            )
            self.proc = None
        return self

    def _until_sampling(self) -> str | None:
        """None once py-spy says it is sampling (warnings before that are skipped); else what it
        said before it exited or ``ATTACH_TIMEOUT_S`` passed: a silent one must not hold the
        window."""
        fd, said = self.proc.stdout.fileno(), b""
        deadline = time.monotonic() + ATTACH_TIMEOUT_S
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([fd], [], [], left)
            chunk = os.read(fd, 4096) if ready else b""
            if not chunk:  # exited (end of its output) or the time is up
                break
            said += chunk
            if b"Sampling" in said:
                return None
        return said.decode(errors="replace")

    def __exit__(self, *exc) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGINT)  # py-spy writes its file when interrupted
        try:
            self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            self.error = "py-spy did not stop within 60 s"
        if self.error is None and not self.path.exists():
            self.error = f"py-spy wrote no {self.path.name}"

    def profile(self, steps: int) -> dict:
        """The window's ``host_profile``: sample counts (:func:`count_samples`), the rate and the
        window's steps; or the error."""
        if self.error:
            return {"error": self.error}
        counted = count_samples(self.path.read_text())
        return {"rate": self.rate, "steps": steps, **counted}
