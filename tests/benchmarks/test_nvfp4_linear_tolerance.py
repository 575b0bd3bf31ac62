"""The GPU error check of benchmarks/nvfp4_linear.py, re-judged on the stored H200 runs: every
measured error of vLLM's FP4 Marlin and of Humming (which adds stream-K partial sums in bf16) is
within its kernel's tolerance, and the layout error of vLLM's own ModelOpt method on fused shards
with different global scales (measured in the same runs) is far outside it."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "nvfp4_linear", _ROOT / "benchmarks" / "nvfp4_linear.py"
)
nl = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("nvfp4_linear", nl)
_spec.loader.exec_module(nl)

RUNS = _ROOT / "benchmarks" / "results" / "2026-12-01-h200-humming"
# result file -> the kernel vLLM picked (TP rows of that run did not record it)
STORED = {
    "nvfp4_linear_humming.json": "HummingNvFp4LinearKernel",
    "nvfp4_linear_marlin.json": "MarlinNvFp4LinearKernel",
    "nvfp4_linear_tp_humming.json": "HummingNvFp4LinearKernel",
}


def _measured(name):
    rows = json.loads((RUNS / name).read_text())["rows"]
    return [r for r in rows if r.get("rel_max_err_bf16") is not None]


@pytest.mark.parametrize("name", sorted(STORED))
def test_every_stored_error_is_within_its_kernels_tolerance(name):
    rows = _measured(name)
    assert len(rows) >= 24
    for r in rows:
        kernel = r.get("kernel") or STORED[name]
        assert kernel == STORED[name]
        assert r["rel_max_err"] <= nl.gpu_tolerance(kernel, r["rel_max_err_bf16"]), r


def test_hummings_bf16_reduction_needs_its_own_tolerance():
    """With the fp32-sum rule, the Humming run fails where K > 1024 (stream-K), never for
    markov_w2 (K = 512, no split: its errors equal Marlin's to the bit)."""
    humming = {(r["case"], r["m"]): r for r in _measured("nvfp4_linear_humming.json")}
    marlin = {(r["case"], r["m"]): r for r in _measured("nvfp4_linear_marlin.json")}
    fp32_rule = lambda r: nl.gpu_tolerance("MarlinNvFp4LinearKernel", r["rel_max_err_bf16"])  # noqa: E731
    over = {key for key, r in humming.items() if r["rel_max_err"] > fp32_rule(r)}
    assert over and all(case != "markov_w2" for case, _ in over)
    for key in ((c, m) for c, m in humming if c == "markov_w2"):
        assert humming[key]["rel_max_err"] == marlin[key]["rel_max_err"]


@pytest.mark.parametrize("kernel", sorted(set(STORED.values())))
def test_a_mis_scaled_shard_fails_under_either_tolerance(kernel):
    layout_errors = [
        r[nl.VLLM_ERR] for r in _measured("nvfp4_linear_humming.json") if r.get(nl.VLLM_ERR)
    ]
    assert layout_errors and min(layout_errors) > 0.5
    for r in _measured("nvfp4_linear_humming.json"):
        assert nl.gpu_tolerance(kernel, r["rel_max_err_bf16"]) < min(layout_errors) / 20
