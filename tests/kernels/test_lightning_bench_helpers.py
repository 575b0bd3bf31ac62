"""Pure helpers of benchmarks/gpu_lightning.py: the synthetic-acceptance schedule and the reduced
target pattern (the GPU run depends on both being right the first time)."""

from __future__ import annotations

import importlib.util
import sys
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
