"""Packed NVFP4 tensors for decoder tests: every byte value and every non-NaN e4m3 scale byte."""

from __future__ import annotations

import torch


def raw_nvfp4(rows: int, cols: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight uint8 [rows, cols/2], weight_scale float8_e4m3fn [rows, cols/16])`` drawn from
    ``g``, with each of the 256 packed byte values at least once (rows * cols / 2 >= 256) and the
    254 non-NaN scale bytes (not 0x7F / 0xFF) spread evenly, in random order."""
    packed = torch.randint(0, 256, (rows, cols // 2), generator=g, dtype=torch.int64)
    packed.view(-1)[:256] = torch.arange(256)
    scale_values = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)])
    n_scales = rows * cols // 16
    scale_bytes = scale_values[torch.arange(n_scales) % len(scale_values)]
    scale_bytes = scale_bytes[torch.randperm(n_scales, generator=g)]
    weight = packed.to(torch.uint8)
    return weight, scale_bytes.to(torch.uint8).view(rows, cols // 16).view(torch.float8_e4m3fn)
