"""Pure helpers of benchmarks/gpu_lightning.py: the synthetic-acceptance schedule and the reduced
target pattern (the GPU run depends on both being right the first time)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_lightning.py"
_spec = importlib.util.spec_from_file_location("gpu_lightning", _PATH)
gl = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("gpu_lightning", gl)  # dataclasses look their module up there
_spec.loader.exec_module(gl)


@pytest.mark.parametrize("method,length,n", [("dflash", 3.18, 5), ("dspark", 3.69, 7)])
def test_geometric_rates_reproduce_nvidia_lengths(method, length, n):
    rates, alpha, expected = gl.acceptance_rates(method, n)
    assert len(rates) == n and abs(expected - length) < 1e-9
    assert all(0 < r <= 1 for r in rates) and rates == sorted(rates, reverse=True)
    assert abs(rates[0] - alpha) < 1e-12 and abs(rates[-1] - alpha**n) < 1e-12


def test_alpha_values_and_dspark_gamma3():
    assert round(gl.geometric_alpha(3.18, 5), 4) == 0.7352
    assert round(gl.geometric_alpha(3.69, 7), 4) == 0.7588
    rates, alpha, expected = gl.acceptance_rates("dspark", 3)
    assert alpha == gl.geometric_alpha(3.69, 7) and round(expected, 2) == 2.77
    with pytest.raises(ValueError):
        gl.geometric_alpha(7.5, 5)


@pytest.mark.parametrize("depth", [29, 30, 40, 52])
def test_reduced_pattern(depth):
    p = gl.reduced_pattern(depth)
    assert len(p) == depth and p.count("*") == 6 and p.count("M") >= 12 and p[0] == "M"
    if depth == 52:
        assert p == gl.REAL_PATTERN and (p.count("M"), p.count("E")) == (23, 23)


def test_reduced_pattern_too_shallow():
    with pytest.raises(ValueError, match="at least 12"):
        gl.reduced_pattern(28)


def test_draft_step_timer_entry_points_exist_in_installed_vllm():
    """Tripwire: the drafter entry points the benchmark times are still there (vLLM 0.32 / 0.33);
    a rename would silently leave draft time per step unmeasured."""
    import importlib

    for module, cls_name, method, _ in gl.TIMED_DRAFT_CALLS:
        cls = getattr(importlib.import_module(module), cls_name)
        assert callable(getattr(cls, method, None)), f"{module}.{cls_name}.{method} is gone"


def test_draft_step_timer_per_step():
    before = [10.0, 20.0, 10.0, 5.0]
    after = [60.0, 70.0, 60.0, 30.0]  # 50 steps, 50 ms of drafting, 25 ms of Markov walk
    got = gl.DraftStepTimer.per_step(before, after, wall_s=0.5)
    assert got == {
        "timed_steps": 50,
        "draft_ms_per_step": 1.0,
        "markov_ms_per_step": 0.5,
        "wall_ms_per_step": 10.0,
    }
    none = gl.DraftStepTimer.per_step(after, after, wall_s=0.5)
    assert none["draft_ms_per_step"] is None and none["wall_ms_per_step"] is None


def test_decode_time_per_step_leaves_the_prefill_out():
    """The last first token's time comes off the wall time; rows without ``ttft_ms_max`` use the
    mean at concurrency 1 only (one request: mean = max), and nothing is guessed elsewhere."""
    row = {"concurrency": 16, "wall_s": 0.5, "ttft_ms": 20.0, "ttft_ms_max": 50.0}
    assert gl.decode_ms_per_step({**row, "timed_steps": 90}) == 5.0
    assert gl.decode_ms_per_step({**row, "timed_steps": 0}) is None
    old = {"concurrency": 1, "wall_s": 0.5, "ttft_ms": 50.0, "timed_steps": 90}
    assert gl.decode_ms_per_step(old) == 5.0
    assert gl.decode_ms_per_step({**old, "concurrency": 16}) is None
    assert gl.median_repeat([old])["decode_ms_per_step_all"] == [5.0]


def test_median_repeat_reports_the_middle_run_and_the_spread():
    rows = [
        {"output_tok_s": v, "tpot_ms": t, "draft_ms_per_step": d}
        for v, t, d in [(674.0, 1.3, 0.87), (497.0, 1.7, 0.87), (600.0, 1.5, 0.88)]
    ]
    got = gl.median_repeat(rows)
    assert got["output_tok_s"] == 600.0 and got["tpot_ms"] == 1.5
    assert got["repeats"] == 3 and got["output_tok_s_all"] == [674.0, 497.0, 600.0]
    assert gl.median_repeat(rows[:2])["output_tok_s"] == 497.0  # even count: the lower middle


def test_loop_runs_switch_the_fused_walk_off_and_run_only_when_named(monkeypatch):
    monkeypatch.delenv("VLLM_NEMOTRON_SPEC_FUSED_MARKOV", raising=False)
    runs = {r.name: r for r in gl.RUNS}
    loop, default = runs["dspark7-ours-loop"], runs["dspark7-ours"]
    assert (loop.method, loop.gamma, loop.plugin) == (default.method, default.gamma, True)
    assert gl.run_env(loop)["VLLM_NEMOTRON_SPEC_FUSED_MARKOV"] == "0"
    assert "VLLM_NEMOTRON_SPEC_FUSED_MARKOV" not in gl.run_env(default)
    assert "VLLM_PLUGINS" not in gl.run_env(loop)
    assert not loop.default and not runs["dspark3-ours-loop"].default
    assert all(r.default for r in gl.RUNS if not r.name.endswith("-loop"))


def test_kernel_lines_name_each_gemm_kernel_once():
    """The benchmarks record which NVFP4 kernel vLLM picked (Humming or FP4 Marlin on Hopper);
    the same line from the engine's two processes counts once."""
    log = (
        "(EngineCore pid=7) INFO 12-01 23:40:20 [__init__.py:1303] Using HummingNvFp4LinearKernel"
        " for NVFP4 GEMM\n"
        "(APIServer pid=3) INFO 12-01 23:40:21 [__init__.py:1303] Using HummingNvFp4LinearKernel"
        " for NVFP4 GEMM\n"
        "INFO [model.py:1] Loading weights took 0.08 seconds\n"
        "INFO [__init__.py:1303] Using MarlinNvFp4LinearKernel for NVFP4 GEMM\n"
    )
    assert gl._common.kernel_lines(log) == [
        "Using HummingNvFp4LinearKernel for NVFP4 GEMM",
        "Using MarlinNvFp4LinearKernel for NVFP4 GEMM",
    ]


def test_runs_start_in_the_order_named_and_interleave_over_rounds():
    """``--runs b,a`` starts b first (the loop/fused comparison depends on it), ``--engines 2``
    repeats the whole list (a, b, a, b), and an unknown name is refused before anything starts."""
    got = [(r.name, k) for r, k in gl.select_runs("dspark3-ours-loop,dspark3-upstream", 2)]
    assert got == [
        ("dspark3-ours-loop", 1),
        ("dspark3-upstream", 1),
        ("dspark3-ours-loop", 2),
        ("dspark3-upstream", 2),
    ]
    assert [r.name for r, _ in gl.select_runs(None)] == [r.name for r in gl.RUNS if r.default]
    assert [r.name for r, _ in gl.select_runs("plain,plain")] == ["plain"]
    with pytest.raises(SystemExit, match="unknown runs \\['dspark9'\\]"):
        gl.select_runs("plain,dspark9")
    with pytest.raises(SystemExit, match="--engines"):
        gl.select_runs("plain", 0)
    assert gl.run_key("plain", 1, 1) == "plain" and gl.run_key("plain", 2, 3) == "plain.2"


def test_task_stat_parsing_survives_spaces_and_parentheses_in_the_name():
    fields = ["S", "41"] + ["0"] * 9 + ["250", "17"] + ["0"] * 23 + ["5"] + ["0"] * 13
    got = gl.parse_task_stat("123 (EngineCore (DP0) x) " + " ".join(fields))
    assert got == {"comm": "EngineCore (DP0) x", "ppid": 41, "ticks": 267, "cpu": 5}
    with open("/proc/self/stat") as fh:
        me = gl.parse_task_stat(fh.read())
    assert me["ppid"] == os.getppid() and me["cpu"] in os.sched_getaffinity(0)


def test_host_sampler_finds_a_busy_child_and_where_it_ran():
    """A child process spinning for ~1.5 s is found in the process tree and reported as the
    busiest thread, with the CPUs it was seen on and their hyperthread siblings."""
    import subprocess

    child = subprocess.Popen(
        [sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass"]
    )
    try:
        time.sleep(0.2)  # the sampler finds the tree when it starts
        with gl.HostSampler(period_s=0.05) as host:
            child.wait(timeout=30)
    finally:
        child.kill()
    summary = host.summary()
    busiest = summary["threads"][0]
    assert busiest["pid"] == child.pid and busiest["cpu_s"] > 0.3, summary
    assert busiest["cpus"] and set(busiest["cpus"]) <= set(summary["siblings"])
    assert set(busiest["cpus"]) <= os.sched_getaffinity(0)
    if os.path.isdir("/sys/devices/system/node/node0"):  # NUMA nodes exposed: each CPU has one
        assert set(summary["numa"]) == set(summary["siblings"]), summary
    assert 0.0 <= summary["steal"] <= 1.0
    assert summary["samples"] >= 2, summary  # the sampler's own cost is recorded
    assert summary["sampler_ms_per_sample"] > 0, summary
    assert len(summary["cpu_probe_ms"]) == 2 and min(summary["cpu_probe_ms"]) > 0, summary
    line = gl.host_line(summary)
    assert line.startswith("host: child python") and f"/{child.pid} " in line, line
    assert line.endswith(f"; {summary['samples']} samples of {summary['sampler_ms_per_sample']} ms")


def test_host_line_reads_a_summary_before_and_after_json():
    """results.md is written from the JSON files too, where the CPU numbers have become strings."""
    summary = {
        "available": True,
        "threads": [
            {"role": "child", "comm": "EngineCore", "tid": 7, "share": 0.97, "cpus": {3: 10, 19: 2}}
        ],
        "siblings": {3: "3,19", 19: "3,19"},
        "numa": {3: 1, 19: 1},
        "mhz": {3: 2400},
        "busy_cpus": {3: 0.9, 19: 0.45},
        "steal": 0.0123,
    }
    want = (
        "host: child EngineCore/7 97% on 3,19 (siblings 3,19; node 1; 2400 MHz);"
        " busy CPUs 3:90%,19:45%; steal 1.2%"
    )
    assert gl.host_line(summary) == want
    assert gl.host_line(json.loads(json.dumps(summary))) == want
    assert gl.host_line({"available": False}) == "host: not sampled"
    summary["gpu"] = {"busy": 0.812, "sm_mhz": [1755, 1980], "watts": 402.5, "clock_reasons": "0x4"}
    assert gl.host_line(summary) == want + (
        "; GPU busy 81%, SM 1755-1980 MHz, 402.5 W, clock reasons 0x4"
    )
    summary["cpu_probe_ms"] = [3.1, 3.456]
    assert gl.host_line(summary) == want + (
        "; CPU probe 3.10/3.46 ms; GPU busy 81%, SM 1755-1980 MHz, 402.5 W, clock reasons 0x4"
    )


def test_host_sampler_summarises_gpu_readings():
    """The GPU summary: mean busy share and power, the SM clock's range, every reason OR-ed;
    no readings (no GPU, no NVML) gives None, and the host line stays as it was."""
    sampler = gl.HostSampler()
    assert sampler._gpu_summary() is None
    sampler.gpu_samples = [(100, 1980, 400.0, 0x0), (60, 1755, 500.0, 0x4), (80, 1830, 450.0, 0x1)]
    assert sampler._gpu_summary() == {
        "busy": 0.8,
        "sm_mhz": [1755, 1980],
        "watts": 450.0,
        "clock_reasons": "0x5",
    }


PY_SPY_RAW = (
    "thread (11): MainThread;run_engine_core (core.py:900);run_busy_loop (core.py:950);"
    "step (core.py:400);execute_model (model_runner.py:100) 30\n"
    "thread (11): MainThread;run_engine_core (core.py:900);run_busy_loop (core.py:950);"
    "step (core.py:410);get_output (model_runner.py:220);synchronize (streams.py:227) 60\n"
    "thread (11): MainThread;run_engine_core (core.py:900);run_busy_loop (core.py:950);"
    "step (core.py:405);execute_model (model_runner.py:130) 10\n"
    "thread (12): Thread-2 (process_output);get (queue.py:171);wait (threading.py:327) 5\n"
)


def test_py_spy_summary_ranks_the_busiest_threads_functions():
    """Shares are of the samples the wall time allows (0.5 s at 250 Hz = 125); one function's
    lines add up; the innermost and the inclusive ranking are of the busiest thread only."""
    got = gl.py_spy_summary(PY_SPY_RAW, wall_s=0.5, rate_hz=250)
    assert got["threads"] == {"MainThread": 0.8, "Thread-2 (process_output)": 0.04}
    assert got["busiest"] == "MainThread"
    assert got["leaves"] == [["synchronize (streams.py)", 0.48], ["execute_model (model_runner.py)", 0.32]]  # fmt: skip
    inclusive = dict(got["inclusive"])
    assert inclusive["step (core.py)"] == 0.8 and inclusive["get_output (model_runner.py)"] == 0.48
    assert "wait (threading.py)" not in inclusive
    # phases: below the loop every sample shares; get_output only ever calls synchronize
    assert got["phases"] == [["synchronize (streams.py)", 0.48], ["execute_model (model_runner.py)", 0.32]]  # fmt: skip
    line = gl.profile_line(got)
    assert line.startswith(
        "py-spy (0.5 s at 250 Hz): busy MainThread 80%, Thread-2 (process_output) 4%;"
    )
    assert (
        "innermost: synchronize (streams.py) 48%, execute_model (model_runner.py) 32%; "
        "MainThread phases (inclusive): synchronize (streams.py) 48%, " in line
    )
    assert gl.profile_line(gl.py_spy_summary("", 0.5, 250)) == "py-spy: no samples"


FAKE_PY_SPY = """import signal, sys, time
args = sys.argv[1:]
out = args[args.index("--output") + 1]
if "FAIL" in out:
    print("Error: Failed to find python version from target process", flush=True)
    sys.exit(1)
print("py-spy> Sampling process 250 times a second. Press Control-C to exit.", flush=True)
def stop(*_):
    open(out, "w").write(open(sys.argv[0] + ".raw").read())
    sys.exit(0)
signal.signal(signal.SIGINT, stop)
time.sleep(60)
"""


def test_host_profile_stops_py_spy_and_reads_its_stacks(tmp_path):
    """The protocol py-spy follows (a line once attached, its file written on Ctrl-C, an error
    line and exit 1 when it cannot attach), played by a stand-in script."""
    fake = tmp_path / "py-spy"
    fake.write_text(f"#!{sys.executable}\n{FAKE_PY_SPY}")
    fake.chmod(0o755)
    (tmp_path / "py-spy.raw").write_text(PY_SPY_RAW)
    with gl.HostProfile(str(fake), os.getpid(), tmp_path / "run.pyspy.txt") as prof:
        time.sleep(0.1)
    assert prof.summary["busiest"] == "MainThread", prof.summary
    assert prof.summary["leaves"][0][0] == "synchronize (streams.py)"
    with gl.HostProfile(str(fake), os.getpid(), tmp_path / "FAIL.txt") as prof:
        pass
    assert "Failed to find python version" in prof.summary["error"]
    assert gl.profile_line(prof.summary).startswith("py-spy: Error: Failed to find python version")


def test_engine_core_pid_is_this_process_when_the_engine_runs_in_process():
    with gl.HostSampler() as host:
        pass
    assert host.engine_core_pid() == os.getpid()


def test_py_spy_option_refuses_a_missing_executable(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        gl.main(["--out", str(tmp_path), "--py-spy", str(tmp_path / "no-such-py-spy")])
    assert exc.value.code == 2
    assert "--py-spy: no executable" in capsys.readouterr().err


def test_run_budget_judges_a_warm_engine_by_its_kind_not_by_the_first_compile():
    """The session's first engine took 265 s, 250 of them starting (JIT, compile). Another engine
    of its kind needs its 15 s of measuring plus a warm start (at most 60 s, less once one was
    seen); a new kind is judged by the longest run; a run that never started counts only there."""
    budget = gl._common.RunBudget(budget_s=500, min_run_s=45, started=time.time())
    loop, upstream = ("dspark", 3, True), ("dspark", 3, False)
    assert budget.need(loop) == 45  # nothing run yet: the floor
    budget.record(loop, took_s=265, startup_s=250)
    assert budget.need(loop) == 0.8 * (15 + 60) == 60
    assert budget.need(upstream) == 0.8 * 265
    budget.record(upstream, took_s=100, startup_s=25)  # a warm start seen: 25 s from now on
    assert budget.need(loop) == 45 and budget.need(upstream) == 0.8 * (75 + 25)
    budget.record(("dflash", 5, True), took_s=400, startup_s=None)  # failed before it was up
    assert budget.need(("dflash", 5, True)) == 0.8 * 400 and budget.need(loop) == 45
    assert 499 < budget.remaining() <= 500
    servers = gl._common.RunBudget(budget_s=500, min_run_s=45, started=time.time(), factor=0.9)
    servers.record("dspark3-ours", took_s=200, startup_s=None)  # gpu_multiturn's 0.9 of a row
    assert servers.need("plain") == 0.9 * 200


def test_results_table_shows_decode_time_and_an_unreported_gpu_numa_node():
    """results.md: wall ms/step with the decode time in brackets, and a GPU without a NUMA node
    named as not reported (a number where there is one), with the py-spy line after the host's."""
    row = {"concurrency": 1, "output_tok_s": 600.0, "tpot_ms": 1.3, "ttft_ms": 50.0,
           "wall_s": 0.41, "timed_steps": 90, "wall_ms_per_step": 410 / 90,
           "host": {"available": True, "threads": [], "siblings": {}, "busy_cpus": {}, "steal": 0.0},
           "py_spy": {"error": "py-spy did not start"}}  # fmt: skip
    run = {"name": "dspark3-ours", "method": "dspark", "plugin": True, "gamma": 3,
           "status": "ok", "concurrency": [row], "gpu_numa_node": None}  # fmt: skip
    text = gl.markdown({"setup": {}, "runs": [run, {**run, "name": "b", "gpu_numa_node": 1}]})
    assert "| 4.56 (4.00) |" in text
    assert "(GPU's NUMA node: not reported): host: " in text
    assert "- b, concurrency 1 (GPU's NUMA node: 1)" in text
    assert text.count("; py-spy: py-spy did not start") == 2


def test_draft_column_is_the_median_over_repeats_not_the_median_tok_s_repeat():
    """The repeat with the median tokens/s held the highest draft time of three (0.995 against
    0.921 and 0.941 on the H200); the column shows 0.941 and the range."""
    rows = [
        {"output_tok_s": v, "draft_ms_per_step": d}
        for v, d in [(2242.0, 0.941), (1834.0, 0.921), (2217.0, 0.995)]
    ]
    row = gl.median_repeat(rows)
    assert row["draft_ms_per_step"] == 0.995
    assert gl.draft_cell(row) == "0.941 [0.921-0.995]"
    assert gl.draft_cell({**row, "markov_ms_per_step": 0.08}) == "0.941 [0.921-0.995] (0.080)"
    assert gl.draft_cell({"draft_ms_per_step": 0.5}) == "0.500"  # rows from before the repeats
    assert gl.draft_cell({"draft_ms_per_step_all": [None]}) == ""
