"""benchmarks/harness/hostprof.py: py-spy's samples of a wall window, by function per step."""

from __future__ import annotations

import time

import pytest

from benchmarks.harness import hostprof
from tests.benchmarks import fake_pyspy

RAW = fake_pyspy.raw()


def test_only_samples_inside_the_timed_window_count_and_each_function_once_a_sample():
    recursive = (f"{fake_pyspy.OUTER};{fake_pyspy.WINDOW};{fake_pyspy.STEP};"
                 "walk (pkg/tree.py:3);walk (pkg/tree.py:5) 6\n")  # fmt: skip
    counted = hostprof.count_samples(RAW + recursive + "not a line\n")
    assert counted["window"] == 25 + 15 + 20 + 4 + 6  # the prefill's step is outside
    assert counted["step"] == 25 + 15 + 20 + 6  # the harness's own loop is outside step()
    assert counted["inclusive"] == {
        "execute_model (gpu/model_runner.py)": 40, "build (backends/mamba2_attn.py)": 25,
        "sample_tokens (gpu/model_runner.py)": 20, "walk (pkg/tree.py)": 6,
    }  # fmt: skip
    assert counted["self"]["execute_model (gpu/model_runner.py)"] == 15
    assert counted["self"]["walk (pkg/tree.py)"] == 6


def test_a_cells_windows_merge_and_its_top_functions_leave_the_wrappers_out():
    one = {"rate": 400, "steps": 10, **hostprof.count_samples(RAW)}
    merged = hostprof.merge([one, one, {"error": "py-spy could not sample"}, None])
    assert merged["steps"] == 20 and merged["step"] == 120
    # 60 samples of 2.5 ms over 10 steps: 15 ms a step in step()
    assert hostprof.ms_per_step(merged, merged["step"]) == pytest.approx(15.0)
    top = hostprof.top_functions(merged)
    assert [name for name, _ in top] == ["build (backends/mamba2_attn.py)",
                                         "sample_tokens (gpu/model_runner.py)"]  # fmt: skip
    assert top[0][1] == pytest.approx(50 * 2.5 / 20)  # execute_model (2/3 of the step) is out
    assert hostprof.describe(one).startswith("15.00 ms/step sampled in step(): build 6.25;")
    assert hostprof.merge([{"error": "x"}]) is None


@pytest.fixture(autouse=True)
def _fresh_process(monkeypatch):
    """Each test a process whose py-spy has not failed yet."""
    monkeypatch.setattr(hostprof, "_gave_up", "")


@pytest.mark.parametrize("warns", [False, True])
def test_the_sampler_records_its_own_process_until_the_window_ends(tmp_path, monkeypatch, warns):
    """py-spy says it is sampling on stdout (a warning on stderr may come first)."""
    monkeypatch.setenv("PATH", fake_pyspy.path_with(tmp_path / "bin"))
    fake_pyspy.install(tmp_path / "bin")
    if warns:
        monkeypatch.setenv("FAKE_PYSPY_WARN", "1")
    with hostprof.Sampler(tmp_path / "w" / "spy.txt", 400) as sampler:
        pass
    profile = sampler.profile(steps=8)
    assert sampler.error is None and profile["rate"] == 400 and profile["steps"] == 8
    assert profile["step"] == 60 and profile["window"] == 64


def test_a_sampler_that_cannot_attach_says_why_and_the_window_goes_on(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", fake_pyspy.path_with(tmp_path / "bin"))
    fake_pyspy.install(tmp_path / "bin")
    monkeypatch.setenv("FAKE_PYSPY_FAIL", "1")
    with hostprof.Sampler(tmp_path / "spy.txt", 400) as sampler:
        ran = True
    assert ran and "Permission Denied" in sampler.profile(8)["error"]
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with hostprof.Sampler(tmp_path / "spy.txt", 400) as sampler:
        pass
    assert sampler.profile(8) == {"error": "py-spy not found on PATH (pip install py-spy)"}


def test_a_silent_py_spy_is_stopped_and_named_not_waited_for(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", fake_pyspy.path_with(tmp_path / "bin"))
    fake_pyspy.install(tmp_path / "bin")
    monkeypatch.setenv("FAKE_PYSPY_SILENT", "1")
    monkeypatch.setattr(hostprof, "ATTACH_TIMEOUT_S", 0.5)
    with hostprof.Sampler(tmp_path / "spy.txt", 400) as sampler:
        pass
    assert sampler.profile(8) == {"error": "py-spy could not sample: nothing within 0.5 s"}


def test_after_py_spy_failed_once_later_windows_do_not_wait_for_it(tmp_path, monkeypatch):
    """A py-spy that could not attach costs its window up to ATTACH_TIMEOUT_S; the process's
    later windows name the first failure at once instead of paying that again."""
    monkeypatch.setenv("PATH", fake_pyspy.path_with(tmp_path / "bin"))
    fake_pyspy.install(tmp_path / "bin")
    monkeypatch.setenv("FAKE_PYSPY_SILENT", "1")
    monkeypatch.setattr(hostprof, "ATTACH_TIMEOUT_S", 0.5)
    with hostprof.Sampler(tmp_path / "spy.txt", 400):
        pass
    monkeypatch.delenv("FAKE_PYSPY_SILENT")  # would sample now, but is not asked again
    started = time.monotonic()
    with hostprof.Sampler(tmp_path / "spy2.txt", 400) as sampler:
        pass
    assert time.monotonic() - started < 0.5 and not (tmp_path / "spy2.txt").exists()
    assert sampler.profile(8) == {
        "error": "py-spy could not sample: nothing within 0.5 s (in an earlier window of this "
        "process; not tried again)"
    }
