"""Tripwire for the private DSparkSpeculator fields the fused Markov walk reads."""

from __future__ import annotations

import types

import pytest
import torch

from vllm_nemotron_spec.patches import v2_dspark_anchor_ids as patch


def test_upstream_speculator_is_the_checked_one_and_sets_the_fields():
    """vLLM 0.32.0 (the CPU tests) has the same V2 speculator source as 0.33.0; the fingerprint
    pins the whole __init__, which assigns the fields the walk reads."""
    import inspect

    from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator

    from vllm_nemotron_spec import patches

    needed, versions = patches.check_target(patch.TARGETS[0], DSparkSpeculator.__init__)
    assert needed and "0.33.0" in versions
    source = inspect.getsource(DSparkSpeculator.__init__)
    assert "self._anchor_idx" in source and "self._draft_topk" in source


def test_a_speculator_without_the_fields_is_a_changed_target():
    from vllm_nemotron_spec import patches

    class DSparkSpeculator:
        def __init__(self):
            self._draft_topk = None

    with pytest.raises(patches.ShapeMismatch, match="DSparkSpeculator.__init__ changed"):
        patches.check_target(patch.TARGETS[0], DSparkSpeculator.__init__)


def test_anchor_token_ids_reads_each_requests_anchor_row():
    speculator = types.SimpleNamespace(
        input_buffers=types.SimpleNamespace(input_ids=torch.tensor([7, 0, 0, 9, 0, 0, 5, 0, 0])),
        _anchor_idx=torch.arange(3) * 3,
    )
    assert patch.anchor_token_ids(speculator, 2).tolist() == [7, 9]
