"""NVFP4 W4A16 linear for a few rows: ``y = x @ W^T`` straight from the checkpoint's packed form.

The drafts' linears run at 1-16 rows a step, where a W4A16 GEMM is a weight stream: its floor is
the packed codes plus block scales over the memory bandwidth. vLLM's kernels (Humming, FP4 Marlin)
reach 1.0-1.6 TB/s there on an H200 (``benchmarks/nvfp4_linear.py``); this kernel is the
candidate measured beside them (``--gemv``). Nothing in the engine calls it yet.

Layout (:mod:`vllm_nemotron_spec.nvfp4.format`): ``weight`` uint8 ``[N, K/2]`` (element ``2j`` in
the low nibble), ``weight_scale`` float8_e4m3fn ``[N, K/16]``, and a global scale per output
row (``row_scale`` fp32 ``[N]``): fused shards keep their own ``weight_scale_2`` exactly, with no
folding. Arithmetic: a code goes to fp16 as ``2^-14 * E2M1[code]`` by placing its bits (exact,
as in :mod:`.markov`), times its fp32 block scale: at most 6 significant bits, so the weight is
exact in bf16 and every product in the bf16 tensor-core dot is exact; sums in fp32, then
``row_scale * 2^14``. K is split over ``split_k`` programs whose fp32 partials a second launch
sums (in fp32) and rounds once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_nemotron_spec.kernels import markov
from vllm_nemotron_spec.nvfp4 import format as nvfp4

if markov.HAVE_TRITON:
    import triton
    import triton.language as tl

    from vllm_nemotron_spec.kernels.markov import _dot, _e4m3_to_f32

    @triton.jit
    def _code_to_f16_bits(c):
        """E2M1 code (0..15, int32) -> fp16 bits of ``2^-14 * E2M1[code]``: magnitude bits to
        bits 11..9 (exponent low bits and the top mantissa bit), sign to bit 15."""
        return ((c & 7) << 9) | ((c & 8) << 12)

    @triton.jit
    def _nvfp4_gemv_kernel(
        x_ptr, w_ptr, s_ptr, g_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_sn,
        stride_os, stride_om, K_PER_SPLIT,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        DOT_MODE: tl.constexpr, NATIVE_FP8: tl.constexpr,
    ):  # fmt: skip
        """Partial ``x[:, ks] @ W[ns, ks]^T * row_scale[ns]`` of one (N block, K split) into
        ``out[split]``; K_PER_SPLIT is a multiple of BLOCK_K."""
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        j = tl.arange(0, BLOCK_K // 2)
        n_ok = rn < N
        m_ok = rm < M
        w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
        s_rows = s_ptr + rn.to(tl.int64)[:, None] * stride_sn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_lo = pid_s * K_PER_SPLIT
        for k0 in range(k_lo, k_lo + K_PER_SPLIT, BLOCK_K):
            kb = k0 // 2 + j  # packed byte columns: inputs 2 * kb and 2 * kb + 1
            ok = n_ok[:, None] & (kb < K // 2)[None, :]
            byte = tl.load(w_rows + kb[None, :], mask=ok, other=0).to(tl.int32)
            # one scale per 16 inputs = per 8 bytes: load a tile's scales once, widen by 8
            sc = k0 // 16 + tl.arange(0, BLOCK_K // 16)
            s_ok = n_ok[:, None] & (sc < K // 16)[None, :]
            scale = _e4m3_to_f32(tl.load(s_rows + sc[None, :], mask=s_ok, other=0), NATIVE_FP8)
            scale = tl.reshape(
                tl.broadcast_to(scale[:, :, None], (BLOCK_N, BLOCK_K // 16, 8)),
                (BLOCK_N, BLOCK_K // 2),
            )
            lo = _code_to_f16_bits(byte & 15).to(tl.uint16).to(tl.float16, bitcast=True)
            hi = _code_to_f16_bits(byte >> 4).to(tl.uint16).to(tl.float16, bitcast=True)
            lo = lo.to(tl.float32) * scale
            hi = hi.to(tl.float32) * scale
            w = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))  # [n, 2j + t] = (lo, hi)[t][n, j]
            xk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(
                x_ptr + rm[:, None] * stride_xm + xk[None, :],
                mask=m_ok[:, None] & (xk < K)[None, :],
                other=0.0,
            )
            acc = _dot(x, tl.trans(w), acc, DOT_MODE)
        g = tl.load(g_ptr + rn, mask=n_ok, other=0.0) * 16384.0  # the 2^-14 of the fp16 codes
        acc = acc * g[None, :]
        out = out_ptr + pid_s * stride_os + rm[:, None] * stride_om + rn[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _sum_splits_kernel(part_ptr, out_ptr, numel, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
        """out = the sum of the fp32 partials [SPLITS, numel], in fp32, rounded once."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < numel
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(SPLITS):
            acc += tl.load(part_ptr + s * numel + offs, mask=ok, other=0.0)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


@dataclass(frozen=True)
class GemvConfig:
    """Launch shape: ``block_n`` output rows and ``block_k`` inputs a tile (``block_k / 2`` bytes
    of each row), ``split_k`` programs along K; Triton's ``num_warps`` / ``num_stages``."""

    block_n: int = 64
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 8  # with 4 this tile spills registers on sm_90 (Triton 3.9)
    num_stages: int = 3


def default_config(m: int, n: int, k: int, num_sms: int) -> GemvConfig:
    """Enough programs to keep loads in flight on every SM (about four a SM): split K when the
    output rows alone give too few."""
    cfg = GemvConfig()
    blocks = markov._cdiv(n, cfg.block_n)
    split = 1
    while blocks * split < 4 * max(num_sms, 1) and k // (split * 2) >= 4 * cfg.block_k:
        split *= 2
    return GemvConfig(split_k=split)


def _dot_mode(x: torch.Tensor) -> int:
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"nvfp4_gemv takes bf16 or fp32 inputs, got {x.dtype}")
    if markov.interpreting() or x.dtype == torch.float32 or x.device.type != "cuda":
        return markov.DOT_FP32  # the interpreter's bf16 dot is broken (see markov)
    return markov.DOT_BF16


def nvfp4_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    row_scale: torch.Tensor,
    cfg: GemvConfig | None = None,
) -> torch.Tensor:
    """``x [M, K] @ W^T`` with W in the checkpoint's packed NVFP4 form and a global scale per
    output row; returns ``[M, N]`` in ``x``'s dtype. Meant for M <= 16 (one row block)."""
    if not markov.HAVE_TRITON:
        raise RuntimeError("nvfp4_gemv needs Triton")
    n, k = nvfp4.logical_shape(tuple(weight.shape))
    m = x.shape[0]
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(
            f"x has shape {tuple(x.shape)}, expected [M, {k}] for weight {tuple(weight.shape)}"
        )
    if weight.dtype != torch.uint8 or weight_scale.dtype != torch.float8_e4m3fn:
        raise TypeError(
            f"weight must be uint8 and weight_scale float8_e4m3fn, got {weight.dtype} / {weight_scale.dtype}"
        )
    if tuple(weight_scale.shape) != (n, k // nvfp4.GROUP_SIZE) or k % nvfp4.GROUP_SIZE:
        raise ValueError(
            f"weight_scale has shape {tuple(weight_scale.shape)}, expected {(n, k // nvfp4.GROUP_SIZE)}"
        )
    if row_scale.shape != (n,) or row_scale.dtype != torch.float32:
        raise ValueError(
            f"row_scale must be fp32 [{n}], got {row_scale.dtype} {tuple(row_scale.shape)}"
        )
    if m > 16:
        raise ValueError(f"nvfp4_gemv takes at most 16 rows, got {m}")
    dot_mode = _dot_mode(x)
    cfg = cfg or default_config(m, n, k, markov._num_sms(x.device))
    x = x.contiguous()
    tiles = markov._cdiv(k, cfg.block_k)
    k_per_split = markov._cdiv(tiles, cfg.split_k) * cfg.block_k  # whole tiles per split
    splits = markov._cdiv(k, k_per_split)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    # One split writes the output itself; several write fp32 partials, summed by a second launch.
    out = (
        y[None] if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    )
    grid = (markov._cdiv(n, cfg.block_n), splits)
    launch = (
        {} if markov.interpreting() else {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    )
    _nvfp4_gemv_kernel[grid](
        x, weight, weight_scale.view(torch.uint8), row_scale, out, m, n, k,
        x.stride(0), weight.stride(0), weight_scale.stride(0), out.stride(0), out.stride(1),
        k_per_split, BLOCK_M=16, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        DOT_MODE=dot_mode, NATIVE_FP8=markov._native_fp8(x.device), **launch,
    )  # fmt: skip
    if splits > 1:
        _sum_splits_kernel[(markov._cdiv(m * n, 1024),)](out, y, m * n, SPLITS=splits, BLOCK=1024)
    return y
