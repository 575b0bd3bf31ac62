"""benchmarks/harness/budget.py: what fits, judged from the starts and windows seen."""

from __future__ import annotations

import pytest

from benchmarks.harness.budget import Budget


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_start_estimates_follow_what_was_seen():
    clock = Clock()
    b = Budget(1000, first_start_s=300, clock=clock)
    assert b.start_estimate() == 300
    b.record_start(320)  # the first start compiled everything
    assert b.start_estimate() == pytest.approx(0.6 * 320)
    b.record_start(80)
    b.record_start(110)
    assert b.start_estimate() == 110  # the longest later start, not the first


def test_fits_and_the_skip_line():
    clock = Clock()
    b = Budget(600, first_start_s=300, clock=clock)
    clock.now = 500
    assert b.remaining() == 100 and b.fits(100) and not b.fits(101)
    assert b.skipped("plain", 250) == (
        "skipped: time budget (plain needs ~250 s, 100 s of --budget-s 600 left)"
    )
    b.record_work("wall-c1", 5)
    b.record_work("wall-c1", 3)
    assert b.work_estimate("wall-c1", 20) == 5 and b.work_estimate("busy-c1", 20) == 20
    with pytest.raises(ValueError, match="--budget-s must be positive"):
        Budget(0, 1)
