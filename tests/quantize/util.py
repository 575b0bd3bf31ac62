"""Small helpers shared by the quantize tests."""

from __future__ import annotations

from pathlib import Path


def bits_equal(a, b) -> bool:
    """Same dtype, shape and bytes (so -0.0 != 0.0 and NaN payloads count)."""
    import torch

    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def tensors(path: Path) -> dict:
    from vllm_nemotron_spec.quantize.safetensors_io import read_tensors

    return read_tensors(path)
