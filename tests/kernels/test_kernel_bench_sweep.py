"""The launch-config sweep of benchmarks/dspark_draft_kernels.py and the ``programs_per_sm``
knob it varies: every swept config must be a valid launch at the real head's shapes (the sweep
runs on the H200 only, where a bad config would cost device time)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from vllm_nemotron_spec.kernels import markov as mk

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "dspark_draft_kernels.py"
_spec = importlib.util.spec_from_file_location("dspark_draft_kernels", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("dspark_draft_kernels", bench)
_spec.loader.exec_module(bench)

VOCAB, RANK = 131072, 512


def test_programs_per_sm_sets_tiles_per_program(monkeypatch):
    monkeypatch.setattr(mk, "_num_sms", lambda device: 132)  # an H200
    tiles = VOCAB // 64  # 2048 tiles of 64 rows
    for pps, expected in ((2, tiles // 264), (4, tiles // 528)):
        cfg = mk.MarkovKernelConfig(block_v=64, programs_per_sm=pps).resolve(
            1, VOCAB, RANK, torch.device("cpu")
        )
        assert cfg.tiles_per_program == expected
        assert cfg.num_programs(VOCAB) == -(-tiles // expected)
    assert (
        mk.MarkovKernelConfig().programs_per_sm == 2
        and mk.default_config(1, RANK).programs_per_sm == 4
    )


@pytest.mark.parametrize("batch", [1, 16, 32])
def test_sweep_configs_are_valid_launches_at_real_shapes(batch, monkeypatch):
    monkeypatch.setattr(mk, "_num_sms", lambda device: 132)
    configs = bench.sweep_configs(mk, bench.REAL, batch)
    assert list(configs)[0] == "default" and len(configs) > 30
    w1 = torch.empty(VOCAB, RANK, dtype=torch.bfloat16, device="meta")
    packed = torch.empty(VOCAB, RANK // 2, dtype=torch.uint8, device="meta")
    scale = torch.empty(VOCAB, RANK // 16, dtype=torch.float8_e4m3fn, device="meta")
    gs = torch.ones(1)
    seen = set()
    for name, cfg in configs.items():
        mk._check_inputs((batch, VOCAB), w1, packed, scale, gs, cfg)
        resolved = cfg.resolve(batch, VOCAB, RANK, torch.device("cpu"))
        key = (resolved.block_v, resolved.num_warps, resolved.block_k, resolved.tiles_per_program,
               resolved.num_stages, resolved.reduction)  # fmt: skip
        assert name.endswith("-atomic") == (resolved.reduction == "atomic") or name == "default"
        assert name == "default" or key not in seen, f"{name} duplicates another config"
        seen.add(key)
    assert bench.fused_candidates(mk, bench.REAL, batch, only_default=False, sweep=True) == configs


def test_sweep_configs_only_keeps_the_named_ones_and_rejects_unknown_names():
    names = ["v128-w4-k64-p4-s2", "v128-w4-k64-p4-s2-atomic"]
    assert list(bench.sweep_configs(mk, bench.REAL, 4, only=names)) == ["default", *names]
    with pytest.raises(SystemExit, match="v1-w1"):
        bench.sweep_configs(mk, bench.REAL, 4, only=["v1-w1"])
