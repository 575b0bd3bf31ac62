"""benchmarks/harness/lanes.py's schedule with lanes that build instantly (no processes): the
order engines start and groups are measured in, one engine at a time or two side by side, arms
that do not fit the budget or fail to start."""

from __future__ import annotations

import pytest

from benchmarks.harness import lanes
from benchmarks.harness.budget import Budget


class FakeProc:
    def is_alive(self):
        return True


class FakeLane:
    """What run_groups uses of a Lane; answers builds in the order they were sent."""

    def __init__(self, name, log, fail=(), slow=()):
        self.name, self.log, self.fail, self.slow = name, log, set(fail), dict.fromkeys(slow, 3)
        self.held, self.building, self.proc = None, False, FakeProc()
        self.log_path, self.pending = f"{name}.log", []

    def mark_log(self):
        pass

    def log_since(self):
        return ""

    def send(self, op):
        self.log.append(("build", op["arm"]["name"]))
        self.pending.append(op["arm"]["name"])

    def ready(self):
        if self.pending and self.slow.get(self.pending[0], 0) > 0:
            self.slow[self.pending[0]] -= 1  # still starting
            return False
        return bool(self.pending)

    def receive(self, timeout):
        name = self.pending.pop(0)
        self.log.append(("up", name))
        if name in self.fail:
            return {"ok": False, "error": "ValueError: no such kernel"}
        return {"ok": True, "startup_s": 1.0}

    def close(self):  # the process ends: what it held is gone
        if self.held is not None:
            self.log.append(("end", self.held.name))
        self.held, self.building = None, False


class FakeLanes(lanes.Lanes):
    def __init__(self, log, fail=(), slow=()):
        self.by_name = {n: FakeLane(n, log, fail, slow) for n in ("alone", "plugin")}


def arm(name):
    return lanes.Arm(name, "plugin" if name.endswith("plugin") else "alone", {"name": name}, 1.0)


def groups():
    return [
        [arm("d3-alone"), arm("d3-plugin")],
        [arm("plain")],
        [arm("d7-alone"), arm("d7-plugin")],
    ]


def run(max_resident, budget=None, fail=(), slow=()):
    log, recorded = [], []
    gs = groups()

    def measure(arms):
        log.append(("measure", tuple(a.name for a in arms)))

    lanes.run_groups(gs, FakeLanes(log, fail, slow), budget or Budget(1e6, 1.0),
                     measure, lambda a: recorded.append((a.name, a.status)), max_resident)  # fmt: skip
    return log, recorded, gs


def test_side_by_side_builds_each_lanes_next_arm_as_soon_as_it_is_free():
    log, _, gs = run(max_resident=2)
    assert [e for e in log if e[0] != "up"] == [
        ("build", "d3-alone"), ("build", "d3-plugin"),
        ("measure", ("d3-alone", "d3-plugin")),
        ("end", "d3-alone"), ("end", "d3-plugin"),
        ("build", "plain"), ("build", "d7-plugin"),  # the plugin lane starts its next one now
        ("measure", ("plain",)),
        ("end", "plain"), ("build", "d7-alone"),
        ("measure", ("d7-alone", "d7-plugin")),
        ("end", "d7-alone"), ("end", "d7-plugin"),  # the lanes stop at the end
    ]  # fmt: skip
    assert all(a.status == "ok" for g in gs for a in g)


def test_nothing_is_measured_while_an_engine_starts():
    log, _, _ = run(max_resident=2, slow={"d7-plugin"})
    assert log.index(("up", "d7-plugin")) < log.index(("measure", ("plain",)))
    for i, event in enumerate(log):
        if event[0] == "measure":
            started = {n for what, n in log[:i] if what == "build"}
            up = {n for what, n in log[:i] if what == "up"}
            assert started == up, f"{event} while {started - up} still starting"


def test_one_engine_at_a_time_goes_arm_by_arm_in_group_order():
    log, _, _ = run(max_resident=1)
    builds = [name for what, name in log if what == "build"]
    assert builds == ["d3-alone", "d3-plugin", "plain", "d7-alone", "d7-plugin"]
    for i, (what, name) in enumerate(log):
        if what == "build" and i:
            # never two engines at once, and each ends with its process (closing an engine
            # leaves GPU memory held in the process)
            assert log[i - 1][0] == "end"


def test_an_arm_that_does_not_fit_is_skipped_and_says_why():
    class Tight(Budget):
        def fits(self, seconds):
            return not self.starts or len(self.starts) < 2

    log, recorded, gs = run(max_resident=2, budget=Tight(1000, 1.0))
    assert ("build", "plain") not in log
    plain = gs[1][0]
    assert plain.status.startswith("skipped: time budget (plain (engine start and measurements)")
    assert ("plain", plain.status) in recorded


def test_an_engine_that_fails_to_start_is_recorded_and_its_pair_is_measured_alone():
    log, _, gs = run(max_resident=2, fail={"d3-alone"})
    assert gs[0][0].status == "error: ValueError: no such kernel"
    assert ("measure", ("d3-plugin",)) in log
    assert gs[0][1].status == "ok"


class SteppingClock:
    """lanes' ``time``: every reading is ``step`` seconds later; sleeping takes no time."""

    def __init__(self, step):
        self.now, self.step = 0.0, step

    def monotonic(self):
        self.now += self.step
        return self.now

    def sleep(self, _):
        pass


def test_a_start_that_runs_past_the_budget_is_stopped_and_says_so(monkeypatch):
    clock = SteppingClock(10.0)  # the start never answers
    monkeypatch.setattr(lanes, "time", clock)

    class Stuck(FakeLane):
        def ready(self):
            return False

        def receive(self, timeout):
            raise lanes.LaneError(f"lane {self.name} gave no answer in {timeout:.0f} s (killed)")

    fakes = FakeLanes([])
    fakes.by_name["alone"] = Stuck("alone", [])
    only = [[arm("d3-alone")]]
    budget = Budget(300, 100.0, clock=clock.monotonic)
    lanes.run_groups(only, fakes, budget, lambda arms: None, lambda a: None, 1)
    status = only[0][0].status
    assert status.startswith("error: engine start stopped after ") and "past --budget-s" in status
    assert "--first-start-s" in status and "gave no answer" in status


def test_a_long_start_that_answers_inside_the_budget_is_not_stopped(monkeypatch):
    """A start may take most of the budget: it is judged against the budget's end, not
    against what was left when it began (480 s budget, a cold start answering after 330 s)."""

    clock = SteppingClock(1.0)
    monkeypatch.setattr(lanes, "time", clock)

    class Cold(FakeLane):
        def ready(self):
            return bool(self.pending) and clock.now >= 330.0

        def receive(self, timeout):
            if not self.ready():  # the real lane: no answer yet, so it is killed
                raise lanes.LaneError(f"lane {self.name} gave no answer in {timeout:.0f} s")
            return super().receive(timeout)

    fakes = FakeLanes([])
    fakes.by_name["plugin"] = Cold("plugin", [])
    only = [[arm("d7-plugin")]]
    budget = Budget(480, 300.0, clock=clock.monotonic)
    lanes.run_groups(only, fakes, budget, lambda arms: None, lambda a: None, 1)
    assert only[0][0].status == "ok"


def test_later_arms_are_judged_by_the_measurements_seen(monkeypatch):
    """An arm's measurements are estimated at 400 s before any ran; the first took 250 s, so with
    ~350 s left the second (a start of ~1 s plus 250 s) still fits and is measured."""
    clock = SteppingClock(0.0)  # moves only when a measurement runs
    monkeypatch.setattr(lanes, "time", clock)
    log = []

    def measure(arms):
        clock.now += 250.0
        log.append(("measure", tuple(a.name for a in arms)))

    two = [
        [lanes.Arm("a", "alone", {"name": "a"}, 400.0)],
        [lanes.Arm("b", "alone", {"name": "b"}, 400.0)],
    ]
    lanes.run_groups(two, FakeLanes(log), Budget(600, 1.0, clock=clock.monotonic), measure,
                     lambda a: None, 1)  # fmt: skip
    assert [a.status for g in two for a in g] == ["ok", "ok"]
    assert ("measure", ("b",)) in log


@pytest.mark.parametrize("text", ["dspark3", "dspark3,plain", "plain,dflash5-plugin"])
def test_speed_arms_parse_into_groups(text):
    from benchmarks.harness.arms import parse_arms

    groups = parse_arms(text)
    flat = [a for g in groups for a in g]
    assert all(a == "plain" or a.endswith(("-alone", "-plugin")) for a in flat)
    assert len(flat) == len(set(flat))


def test_any_drafted_token_count_is_an_arm():
    from benchmarks.harness.arms import method_of, parse_arms

    assert parse_arms("dspark5-plugin,dflash2") == [
        ["dspark5-plugin"],
        ["dflash2-alone", "dflash2-plugin"],
    ]
    assert method_of("dspark5-plugin") == ("dspark", 5) and method_of("plain") == (None, 0)


def test_speed_arms_refuse_unknown_names():
    from benchmarks.harness.arms import parse_arms

    for name in ("dspark0", "eagle3", "dspark", "dspark4-both", "dflash100"):
        with pytest.raises(SystemExit, match=f"unknown arm '{name}'"):
            parse_arms(name)
    with pytest.raises(SystemExit, match="names an arm twice"):
        parse_arms("dspark3,dspark3-plugin")
