"""Reference NVFP4 (ModelOpt W4A16) packing and dequantization, in plain torch.

This module is the single definition of the on-disk format that every other part of the
package (the tiny-model builder, the vLLM linear method, the inspector) agrees on:

* ``weight``         uint8   ``[out, in // 2]``: two E2M1 codes per byte, element ``2j`` in the
  LOW nibble, element ``2j + 1`` in the high nibble.
* ``weight_scale``   float8_e4m3fn ``[out, in // 16]``: one block scale per 16 inputs.
* ``weight_scale_2`` float32 scalar: the global scale, ``amax / (6 * 448)``.

``value = E2M1[code] * float(weight_scale[r, c // 16]) * weight_scale_2``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_nemotron_spec.checkpoint.layout import (  # noqa: F401 (part of this module's API)
    GROUP_SIZE,
    _check_logical,
    logical_shape,
    packed_shape,
    scale_shape,
)

E2M1_MAX = 6.0
FP8_E4M3_MAX = 448.0

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""Magnitudes of the eight non-negative E2M1 codes; codes 8..15 are the same values negated."""


def e2m1_table(dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """The 16 values an E2M1 code stands for, indexed by code."""
    pos = torch.tensor(E2M1_VALUES, dtype=dtype, device=device)
    return torch.cat([pos, -pos])


@dataclass(frozen=True)
class NVFP4Weight:
    """One linear weight in the packed checkpoint form (the three tensors ModelOpt writes)."""

    weight: torch.Tensor  # uint8 [out, in // 2]
    weight_scale: torch.Tensor  # float8_e4m3fn [out, in // 16]
    weight_scale_2: torch.Tensor  # float32 scalar

    @property
    def logical_shape(self) -> tuple[int, int]:
        return logical_shape(tuple(self.weight.shape))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.weight, self.weight_scale, self.weight_scale_2, dtype=dtype)

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """Checkpoint entries for module ``prefix`` (e.g. ``layers.0.mlp.up_proj``)."""
        return {
            f"{prefix}.weight": self.weight,
            f"{prefix}.weight_scale": self.weight_scale,
            f"{prefix}.weight_scale_2": self.weight_scale_2,
        }


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[out, in/2]`` -> uint8 codes ``[out, in]`` (low nibble first)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed NVFP4 weight must be uint8, got {packed.dtype}")
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack([low, high], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[out, in]`` (values 0..15) -> uint8 ``[out, in/2]``, low nibble first."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd number of codes per row: {tuple(codes.shape)}")
    if codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool:
        raise TypeError(f"E2M1 codes must be an integer tensor, got {codes.dtype}")
    # Check the range before the cast: a cast to uint8 would wrap -1 or 256 into range.
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 15):
        raise ValueError(
            f"E2M1 codes must lie in 0..15, got values in {int(codes.min())}..{int(codes.max())}"
        )
    codes = codes.to(torch.uint8)
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def dequantize(
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor | float,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Packed NVFP4 tensors -> dense ``[out, in]`` weight (computed in fp32, cast to ``dtype``)."""
    out_features, in_features = logical_shape(tuple(weight.shape))
    expected_scale = (out_features, in_features // GROUP_SIZE)
    if tuple(weight_scale.shape) != expected_scale:
        raise ValueError(
            f"weight_scale has shape {tuple(weight_scale.shape)}, expected {expected_scale} "
            f"for a packed weight of shape {tuple(weight.shape)} (logical {(out_features, in_features)})"
        )
    if weight_scale.dtype != torch.float8_e4m3fn:
        raise TypeError(f"weight_scale must be float8_e4m3fn, got {weight_scale.dtype}")
    global_scale = torch.as_tensor(weight_scale_2, dtype=torch.float32).reshape(-1)
    if global_scale.numel() != 1:
        raise ValueError(f"weight_scale_2 must be a scalar, got shape {tuple(global_scale.shape)}")
    values = e2m1_table(device=weight.device)[unpack_codes(weight).long()]
    block = weight_scale.to(torch.float32).repeat_interleave(GROUP_SIZE, dim=1)
    return (values * block * global_scale.to(weight.device)).to(dtype)


def _round_to_e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code for each element of ``x`` (already divided by its scale; |x| <= 6).

    Ties go to the even mantissa, as in the hardware conversion (cvt.rn.satfinite.e2m1x2).
    """
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=x.device)
    ax = x.abs().clamp(max=E2M1_MAX)
    # Midpoints between neighbouring magnitudes; a value equal to a midpoint goes to the
    # neighbour with an even code (0, 2, 4, 6 -> 0.0, 1.0, 2.0, 4.0).
    mid = (mags[1:] + mags[:-1]) / 2
    # bucketize(right=False) puts a value equal to mid[k] at index k, the lower neighbour;
    # a tie whose lower neighbour has an odd code belongs to the upper (even) one.
    idx = torch.bucketize(ax, mid, right=False)
    tie = (idx < len(mid)) & (ax == mid[idx.clamp(max=len(mid) - 1)])
    idx = torch.where(tie & (idx % 2 == 1), idx + 1, idx)
    sign = ((x < 0) & (idx > 0)).to(torch.long) * 8
    return (idx + sign).to(torch.uint8)


def quantize(weight: torch.Tensor, global_scale: float | None = None) -> NVFP4Weight:
    """Dense ``[out, in]`` weight -> NVFP4 (the ModelOpt weight-only recipe).

    global scale = amax / (6 * 448); block scale = fp8(block_amax / 6 / global scale);
    codes = round-to-nearest-even of w / (block scale * global scale).
    """
    out_features, in_features = _check_logical(tuple(weight.shape))
    w = weight.detach().to(torch.float32)
    if global_scale is None:
        amax = float(w.abs().max())
        global_scale = amax / (E2M1_MAX * FP8_E4M3_MAX) if amax > 0 else 1.0
    gs = torch.as_tensor(global_scale, dtype=torch.float32).reshape(()).cpu()
    blocks = w.reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
    block_amax = blocks.abs().amax(dim=-1)
    block_scale = (block_amax / E2M1_MAX / gs).clamp(max=FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    denom = block_scale.to(torch.float32) * gs
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    scaled = blocks / safe.unsqueeze(-1)
    codes = _round_to_e2m1_codes(scaled).reshape(out_features, in_features)
    return NVFP4Weight(pack_codes(codes), block_scale, gs)
