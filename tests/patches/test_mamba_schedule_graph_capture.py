"""Tripwire for the Mamba capture of a per-batch-size schedule: the method the patch rewrites is
upstream's with the equality assertion once; upstream's fails the capture of ``1 + k`` rows for a
k below ``num_speculative_tokens`` (the engine-start failure), the rewritten one builds it as a
decode batch and keeps upstream's bound (served with CUDA graphs on a GPU: tests/gpu/)."""

from __future__ import annotations

import inspect
import types

import pytest
import torch

from vllm_nemotron_spec import patches
from vllm_nemotron_spec.patches import mamba_schedule_graph_capture as patch

NUM_SPEC, MAX_BS = 7, 64


def _upstream():
    from vllm.v1.attention.backends.mamba_attn import BaseMambaAttentionMetadataBuilder

    method = BaseMambaAttentionMetadataBuilder.build_for_cudagraph_capture
    return getattr(method, "__wrapped__", method)


def test_upstream_capture_is_the_checked_one_with_the_equality_once():
    method = _upstream()
    needed, versions = patches.check_target(patch.TARGETS[0], method)
    assert needed and "0.32.0" in versions
    assert inspect.getsource(method).count(patch.UPSTREAM_EQUALITY) == 1


def _builder():
    """What the capture reads of its builder; ``build`` records what it is given."""
    calls = []

    def build(common_prefix_len, m, **kwargs):
        calls.append((common_prefix_len, kwargs))
        return "metadata"

    return types.SimpleNamespace(
        num_spec_tokens=NUM_SPEC, decode_cudagraph_max_bs=MAX_BS, build=build
    ), calls


def _uniform_decode(num_reqs: int, query_len: int):
    """The common metadata of a capture: ``num_reqs`` requests of ``query_len`` rows each."""
    return types.SimpleNamespace(
        num_reqs=num_reqs,
        max_query_len=query_len,
        query_start_loc=torch.arange(0, (num_reqs + 1) * query_len, query_len),
    )


@pytest.mark.parametrize("k", [0, 1, 3])
def test_upstream_fails_a_scheduled_k_below_the_block_and_the_patch_captures_it(k):
    builder, calls = _builder()
    with pytest.raises(AssertionError):
        _upstream()(builder, _uniform_decode(4, 1 + k))
    assert calls == []
    rewritten = patch.any_scheduled_k_capture(_upstream())
    assert rewritten(builder, _uniform_decode(4, 1 + k)) == "metadata"
    ((prefix, kwargs),) = calls
    assert prefix == 0
    # each request's rows are its accepted count at capture: 1 + k, as the decode kernels read
    assert kwargs["num_accepted_tokens"].tolist() == [1 + k] * 4


def test_the_patch_keeps_the_block_capture_and_upstreams_bound():
    rewritten = patch.any_scheduled_k_capture(_upstream())
    builder, calls = _builder()
    assert rewritten(builder, _uniform_decode(MAX_BS, 1 + NUM_SPEC)) == "metadata"
    assert calls[0][1]["num_accepted_tokens"].tolist() == [1 + NUM_SPEC] * MAX_BS
    with pytest.raises(AssertionError, match="decode-only full CUDAGraph capture"):
        rewritten(builder, _uniform_decode(4, 2 + NUM_SPEC))  # more rows than a block
    with pytest.raises(AssertionError, match="decode-only full CUDAGraph capture"):
        rewritten(builder, _uniform_decode(MAX_BS + 1, 2))  # more requests than captured


def test_a_changed_method_is_refused_not_guessed():
    def build_for_cudagraph_capture(self, m):
        assert m.max_query_len <= 1 + self.num_spec_tokens
        return self.build(0, m)

    with pytest.raises(patches.RewriteMismatch, match="found 0 times"):
        patch.rewritten_source_tree(build_for_cudagraph_capture)


def test_registering_installs_it_on_the_builder():
    from vllm.v1.attention.backends.mamba_attn import BaseMambaAttentionMetadataBuilder

    patches.apply_one("mamba_schedule_graph_capture")
    assert patches.is_installed("mamba_schedule_graph_capture"), patches.state(
        "mamba_schedule_graph_capture"
    )
    method = BaseMambaAttentionMetadataBuilder.build_for_cudagraph_capture
    assert getattr(method, "_nemotron_spec_patch", False)


def _config(schedule):
    spec = types.SimpleNamespace(num_speculative_tokens_per_batch_size=schedule)
    cache = types.SimpleNamespace(enable_prefix_caching=False)
    return types.SimpleNamespace(speculative_config=spec, cache_config=cache)


def test_a_schedule_on_a_gpu_needs_the_patch_and_nothing_else_does():
    from vllm_nemotron_spec.target_hook import needed_patches

    name = "mamba_schedule_graph_capture"
    assert name in needed_patches(_config([[1, 4, 7], [5, 64, 3]]), cpu=False)
    assert name not in needed_patches(_config(None), cpu=False)
    assert name not in needed_patches(_config([[1, 4, 7]]), cpu=True)  # no CUDA graphs there
