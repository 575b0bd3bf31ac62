"""Writing large random checkpoints fast: a streaming safetensors writer and pools of random bytes.

A benchmark checkpoint needs valid values of the right dtype and shape, not trained ones: kernel
time does not depend on the values. Generating ~20 GB of fresh random numbers would take minutes,
so each tensor's bytes are a window of a pool of random values (generated once, vectorised) at an
offset derived from the tensor's name: tensors differ from each other, and writing is bound by the
disk. The file format (https://github.com/huggingface/safetensors): an 8-byte little-endian header
length, a JSON header (name -> dtype, shape, byte offsets; ``__metadata__``), padded with spaces
to 8 bytes, then the tensors' bytes in header order.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DTYPES = {"U8": 1, "F8_E4M3": 1, "BF16": 2, "F32": 4, "F16": 2, "I64": 8}
"""safetensors dtype names and their element sizes."""
CHUNK = 64 << 20


class Pool:
    """Random bytes to window from. ``data``: a 1-D uint8 array whose length is a multiple of
    ``element`` (the element size of the dtype it holds)."""

    def __init__(self, data: np.ndarray, element: int):
        if data.dtype != np.uint8 or data.ndim != 1 or len(data) % element:
            raise ValueError("a pool is a 1-D uint8 array holding whole elements")
        self.data, self.element = data, element

    def chunks(self, nbytes: int, key: str) -> Iterator[memoryview]:
        """``nbytes`` bytes starting at an element-aligned offset that ``key`` decides, wrapping
        around the pool."""
        n = len(self.data)
        pos = (zlib.crc32(key.encode()) * 7919 * self.element) % n
        left = nbytes
        while left > 0:
            take = min(left, n - pos, CHUNK)
            yield memoryview(self.data[pos : pos + take])
            left -= take
            pos = (pos + take) % n


def uniform_byte_pool(nbytes: int, low: int, high: int, seed: int) -> Pool:
    """Bytes uniform in ``[low, high]`` (e.g. E2M1 code pairs: 0..255; float8 e4m3 scale
    encodings)."""
    rng = np.random.default_rng(seed)
    return Pool(rng.integers(low, high + 1, size=nbytes, dtype=np.uint8), 1)


def bf16_normal_pool(count: int, std: float, seed: int) -> Pool:
    """``count`` BF16 values drawn from N(0, std^2) (rounded to nearest even from float32)."""
    rng = np.random.default_rng(seed)
    f32 = (rng.standard_normal(count, dtype=np.float32) * np.float32(std)).view(np.uint32)
    rounded = ((f32 + 0x7FFF + ((f32 >> 16) & 1)) >> 16).astype(np.uint16)
    return Pool(rounded.view(np.uint8), 2)


def fp8_e4m3_normal_pool(count: int, seed: int) -> Pool:
    """``count`` float8 e4m3fn values close to N(0, 1) draws (finite: no NaN encoding)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    values = torch.randn(count, generator=g).clamp(-448, 448).to(torch.float8_e4m3fn)
    return Pool(values.view(torch.uint8).numpy().copy(), 1)


def constant(value: float, dtype: str, count: int = 1) -> bytes:
    """``count`` copies of ``value`` in ``dtype`` (F32 or BF16)."""
    if dtype == "F32":
        return struct.pack("<f", value) * count
    if dtype == "BF16":
        f32 = struct.unpack("<I", struct.pack("<f", value))[0]
        return struct.pack("<H", (f32 + 0x7FFF + ((f32 >> 16) & 1)) >> 16) * count
    raise ValueError(f"constant: dtype must be F32 or BF16, got {dtype}")


@dataclass
class Entry:
    """One tensor: its bytes are ``data`` (small tensors) or a window of ``pool``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: bytes | None = None
    pool: Pool | None = None

    @property
    def nbytes(self) -> int:
        n = DTYPES[self.dtype]
        for d in self.shape:
            n *= d
        return n

    def chunks(self) -> Iterator[memoryview | bytes]:
        if self.data is not None:
            if len(self.data) != self.nbytes:
                raise ValueError(
                    f"{self.name}: {len(self.data)} bytes given, {self.dtype} {self.shape} "
                    f"needs {self.nbytes}"
                )
            yield self.data
        elif self.pool is not None:
            if DTYPES[self.dtype] % self.pool.element and self.pool.element % DTYPES[self.dtype]:
                raise ValueError(f"{self.name}: pool of {self.pool.element}-byte elements")
            yield from self.pool.chunks(self.nbytes, self.name)
        else:
            raise ValueError(f"{self.name}: neither data nor a pool")


def write_safetensors(path: str | Path, entries: list[Entry], metadata: dict | None = None) -> int:
    """Stream ``entries`` into a safetensors file; returns the bytes of tensor data written."""
    unknown = {e.dtype for e in entries} - DTYPES.keys()
    if unknown:
        raise ValueError(f"unknown safetensors dtypes {sorted(unknown)}; known: {sorted(DTYPES)}")
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for e in entries:
        if e.name in header:
            raise ValueError(f"tensor {e.name!r} twice in one file")
        header[e.name] = {
            "dtype": e.dtype,
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        for e in entries:
            for chunk in e.chunks():
                fh.write(chunk)
    tmp.replace(path)
    return offset


def write_sharded(
    directory: str | Path, entries: list[Entry], shard_bytes: int, progress=None
) -> list[str]:
    """``model-0000i-of-0000n.safetensors`` files of at most ~``shard_bytes`` each (a tensor is
    never split) and ``model.safetensors.index.json``; returns the file names. ``progress``:
    called with (files done, files, bytes done, bytes) after each file."""
    directory = Path(directory)
    shards: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    total = sum(e.nbytes for e in entries)
    done = 0
    weight_map = {}
    for i, (name, shard) in enumerate(zip(names, shards)):
        done += write_safetensors(directory / name, shard)
        weight_map.update({e.name: name for e in shard})
        if progress:
            progress(i + 1, len(shards), done, total)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    return names
