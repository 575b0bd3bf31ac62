"""The fused Markov walk's ``programs_per_sm`` launch knob at the real head's shapes (the
launch grid it gives on an H200's 132 SMs), and the defaults per batch."""

from __future__ import annotations

import torch

from vllm_nemotron_spec.kernels import markov as mk

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
