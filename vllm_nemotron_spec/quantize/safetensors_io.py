"""Reading a checkpoint directory's tensors, and writing shards tensor by tensor with a progress bar.

Needs only torch and safetensors (the modelopt worker imports it in an environment without vLLM).

The writer produces standard safetensors files (an 8-byte little-endian header length, the JSON
header padded with spaces to a multiple of 8 bytes, then the tensors' bytes back to back in header
order), one tensor at a time, so the bar moves with the bytes written and no second copy of a shard
is built in memory. Several shards get Hugging Face's names (``model-00001-of-00003.safetensors``)
and a ``model.safetensors.index.json``; one shard is ``model.safetensors``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def checkpoint_files(directory: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory: those its index names, else every
    ``*.safetensors`` file (sorted)."""
    directory = Path(directory)
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        files = [directory / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shard(s) that do not exist: {missing}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors file in {directory}")
    return files


def read_tensors(directory: str | Path, names=None) -> dict[str, "torch.Tensor"]:
    """Tensors of a checkpoint directory by name (all of them, or only ``names``). A name stored in
    two files is an error."""
    from safetensors import safe_open

    wanted = None if names is None else set(names)
    out: dict[str, torch.Tensor] = {}
    where: dict[str, str] = {}
    for file in checkpoint_files(directory):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if wanted is not None and key not in wanted:
                    continue
                if key in out:
                    raise ValueError(
                        f"tensor {key} is stored twice: in {where[key]} and {file.name}"
                    )
                out[key] = f.get_tensor(key)
                where[key] = file.name
    if wanted is not None:
        missing = sorted(wanted - set(out))
        if missing:
            raise KeyError(f"{directory}: tensor(s) not found: {missing}")
    return out


def safetensors_dtype(dtype) -> str:
    import torch

    table = {
        torch.bfloat16: "BF16",
        torch.float16: "F16",
        torch.float32: "F32",
        torch.float64: "F64",
        torch.uint8: "U8",
        torch.int8: "I8",
        torch.int16: "I16",
        torch.int32: "I32",
        torch.int64: "I64",
        torch.bool: "BOOL",
        torch.float8_e4m3fn: "F8_E4M3",
        torch.float8_e5m2: "F8_E5M2",
    }
    try:
        return table[dtype]
    except KeyError:
        raise TypeError(f"no safetensors dtype for {dtype}") from None


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def plan_shards(tensors: dict, max_shard_bytes: int) -> list[list[str]]:
    """Names per shard, in the dict's order: a shard is closed before the tensor that would take it
    past ``max_shard_bytes`` (a tensor larger than that gets a shard of its own)."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max shard size must be positive, got {max_shard_bytes}")
    shards: list[list[str]] = []
    size = 0
    for name, t in tensors.items():
        n = _nbytes(t)
        if not shards or (size + n > max_shard_bytes and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def shard_file_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _header(tensors: dict, names: list[str], metadata: dict | None) -> bytes:
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name in names:
        t = tensors[name]
        n = _nbytes(t)
        header[name] = {
            "dtype": safetensors_dtype(t.dtype),
            "shape": [int(d) for d in t.shape],
            "data_offsets": [offset, offset + n],
        }
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-(8 + len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _tensor_bytes(t) -> memoryview:
    """The tensor's bytes (little-endian, as stored in memory), without a copy."""
    import torch

    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def write_shards(
    tensors: dict,
    outdir: str | Path,
    *,
    max_shard_bytes: int,
    metadata: dict | None = None,
    progress: bool = True,
    desc: str = "writing shards",
) -> list[str]:
    """Write ``tensors`` (name -> tensor, in the order given) as safetensors shards into
    ``outdir``; returns the file names (plus the index when there are several shards)."""
    from tqdm import tqdm

    outdir = Path(outdir)
    shards = plan_shards(tensors, max_shard_bytes)
    names = shard_file_names(len(shards))
    total = sum(_nbytes(t) for t in tensors.values())
    bar = tqdm(
        total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, disable=not progress
    )
    try:
        for file_name, members in zip(names, shards):
            bar.set_postfix_str(file_name)
            with open(outdir / file_name, "wb") as f:
                f.write(_header(tensors, members, metadata))
                for name in members:
                    f.write(_tensor_bytes(tensors[name]))
                    bar.update(_nbytes(tensors[name]))
    finally:
        bar.close()
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": total},
            "weight_map": {n: f for f, members in zip(names, shards) for n in members},
        }
        (outdir / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        return names + [INDEX_FILE]
    return names


def parse_size(text: str | int) -> int:
    """``"5GB"``, ``"500MB"``, ``"64KiB"``, ``"1000"`` -> bytes (GB = 10^9, GiB = 2^30)."""
    if isinstance(text, int):
        return text
    s = str(text).strip().upper().replace(" ", "")
    units = {
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "B": 1,
        "": 1,
    }
    for unit in sorted(units, key=len, reverse=True):
        if s.endswith(unit):
            number = s[: len(s) - len(unit)] if unit else s
            try:
                value = float(number)
            except ValueError:
                break
            if value <= 0:
                break
            return int(value * units[unit])
    raise ValueError(f"not a size: {text!r} (examples: 5GB, 500MB, 64KiB, 1000000)")
