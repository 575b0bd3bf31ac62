"""The device budget: what still fits in ``--budget-s``, judged from what this run has seen.

An engine's start-up dominates: a fresh machine's first Lightning engine JIT-compiles kernels and
compiles the model for minutes, later engines read those caches. Until a start has been seen the
estimate is ``first_start_s``; after that, a later start is judged by the longest start seen
after the first one (or a fraction of the first while only the first is known). Measurements are
judged by the longest one of the same label seen so far, else a default the caller gives.
Anything that does not fit is skipped and recorded as skipped, never started and cut off.
"""

from __future__ import annotations

import time


class Budget:
    LATER_START_SHARE = 0.6  # a later start, while only the first has been seen

    def __init__(self, budget_s: float, first_start_s: float, clock=time.monotonic):
        if budget_s <= 0:
            raise ValueError(f"--budget-s must be positive, got {budget_s}")
        self.budget_s, self.first_start_s, self.clock = budget_s, first_start_s, clock
        self.t0 = clock()
        self.starts: list[float] = []
        self.work: dict[str, float] = {}

    def elapsed(self) -> float:
        return self.clock() - self.t0

    def remaining(self) -> float:
        return self.budget_s - self.elapsed()

    def start_estimate(self) -> float:
        if not self.starts:
            return self.first_start_s
        if len(self.starts) == 1:
            return self.LATER_START_SHARE * self.starts[0]
        return max(self.starts[1:])

    def record_start(self, seconds: float) -> None:
        self.starts.append(seconds)

    def work_estimate(self, label: str, default: float) -> float:
        return self.work.get(label, default)

    def record_work(self, label: str, seconds: float) -> None:
        self.work[label] = max(seconds, self.work.get(label, 0.0))

    def fits(self, seconds: float) -> bool:
        return self.remaining() >= seconds

    def skipped(self, what: str, need_s: float) -> str:
        """The line that says why ``what`` is skipped."""
        return (
            f"skipped: time budget ({what} needs ~{need_s:.0f} s, {max(0.0, self.remaining()):.0f} s "
            f"of --budget-s {self.budget_s:.0f} left)"
        )
