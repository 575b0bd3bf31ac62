"""Tripwire for the private DSparkSpeculator fields the fused Markov walk reads."""

from __future__ import annotations

import types

import pytest
import torch

from vllm_nemotron_spec.patches import v2_dspark_anchor_ids as patch


def test_upstream_speculator_still_sets_the_fields():
    """vLLM 0.32.0 (the CPU tests) has the same V2 speculator source as 0.33.0 here."""
    from vllm.v1.worker.gpu.spec_decode.dspark import speculator

    patch._check(speculator)


def test_check_fails_when_a_field_is_gone():
    class DSparkSpeculator:
        def __init__(self):
            self._draft_topk = None

    with pytest.raises(AttributeError, match="_anchor_idx"):
        patch._check(types.SimpleNamespace(DSparkSpeculator=DSparkSpeculator))


def test_anchor_token_ids_reads_each_requests_anchor_row():
    speculator = types.SimpleNamespace(
        input_buffers=types.SimpleNamespace(input_ids=torch.tensor([7, 0, 0, 9, 0, 0, 5, 0, 0])),
        _anchor_idx=torch.arange(3) * 3,
    )
    assert patch.anchor_token_ids(speculator, 2).tolist() == [7, 9]
