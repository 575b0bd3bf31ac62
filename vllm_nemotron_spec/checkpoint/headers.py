"""Read a draft checkpoint without loading a weight: its config files and safetensors headers.

From a local directory (or its config.json), a snapshot in the Hugging Face cache, or the Hub
(config files downloaded, tensor headers from its safetensors metadata: header byte ranges only).
Of each safetensors file only the JSON header is read (names, dtypes, shapes, data offsets),
with the shards listed in ``model.safetensors.index.json``; what the file itself gets wrong
(truncation, overlaps, a bad index) is reported here. Checking the tensors against the draft's
config is ``checkpoint.check``'s.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

from vllm_nemotron_spec.checkpoint.spec import DraftSpecError, read_config_json

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit

DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
    "C64": 8,
    "F4": None,
    "F6_E2M3": None,
    "F6_E3M2": None,  # sub-byte: size not checked
}
"""Bytes per element of every safetensors dtype."""

FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")
"""Dtypes an unquantized tensor may have (the official drafts use BF16)."""


class CheckpointError(DraftSpecError):
    """The checkpoint's files or tensors are inconsistent (every problem in ``problems``)."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors dtype string: "BF16", "U8", "F8_E4M3", "F32", ...
    shape: tuple[int, ...]
    file: str  # file name relative to the checkpoint directory
    truncated: bool = False  # its data lies (partly) past the end of a truncated file


@dataclass(frozen=True)
class CheckpointScan:
    """What the headers of a checkpoint directory say, with every problem found."""

    directory: str
    files: tuple[str, ...]
    index: str | None
    tensors: dict[str, TensorInfo]
    problems: tuple[str, ...]
    warnings: tuple[str, ...]


# --------------------------------------------------------------------------------------------
# Reading headers.


def read_safetensors_header(path: str) -> dict[str, TensorInfo]:
    """Tensors listed in one safetensors file's header; raises :class:`CheckpointError`."""
    problems: list[str] = []
    tensors = _read_header(os.fspath(path), os.path.basename(path), problems)
    if problems:
        raise CheckpointError(problems)
    return tensors


def read_checkpoint(directory: str) -> dict[str, TensorInfo]:
    """All tensors of a checkpoint directory (single file or sharded); raises
    :class:`CheckpointError` listing every problem."""
    scan = scan_checkpoint(directory)
    if scan.problems:
        raise CheckpointError(scan.problems)
    return scan.tensors


def _read_header(path: str, label: str, problems: list[str]) -> dict[str, TensorInfo]:
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                problems.append(
                    f"{label}: {size} bytes, too short for a safetensors file (it starts with an "
                    "8-byte header length)"
                )
                return {}
            length = int.from_bytes(prefix, "little")
            if length > MAX_HEADER_BYTES or length > size - 8:
                problems.append(
                    f"{label}: header length {length} exceeds "
                    + (
                        f"the file ({size} bytes)"
                        if length <= MAX_HEADER_BYTES
                        else f"the safetensors limit ({MAX_HEADER_BYTES} bytes)"
                    )
                    + ": not a safetensors file, or truncated"
                )
                return {}
            raw = f.read(length)
    except OSError as exc:
        problems.append(f"{label}: cannot read ({exc.strerror or exc})")
        return {}
    try:
        header = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        problems.append(f"{label}: header is not UTF-8 (byte {exc.start})")
        return {}
    except json.JSONDecodeError as exc:
        problems.append(f"{label}: header is not valid JSON (char {exc.pos}: {exc.msg})")
        return {}
    except RecursionError:
        problems.append(f"{label}: header is not valid JSON (nested too deeply)")
        return {}
    except ValueError as exc:  # e.g. an integer literal beyond Python's digit limit
        problems.append(f"{label}: header is not valid JSON ({exc})")
        return {}
    if not isinstance(header, dict):
        problems.append(f"{label}: header must be a JSON object, found {type(header).__name__}")
        return {}

    data_len = size - 8 - length
    described = _described_data_end(header)
    truncated = described > data_len
    if truncated:
        past = sorted(
            n for n, e in header.items() if n != "__metadata__" and _end_offset(e) > data_len
        )
        problems.append(
            f"{label}: truncated: the file has {size} bytes but its header describes "
            f"{8 + length + described} ({8 + length + described - size} missing); "
            f"{len(past)} tensor(s) lie past its end: {name_list(past)}"
        )
    tensors: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                problems.append(f"{label}: `__metadata__` must map strings to strings")
            continue
        info = _tensor_entry(name, entry, label, max(data_len, described), problems)
        if info is not None:
            if info[2] > data_len:
                info = (
                    TensorInfo(info[0].name, info[0].dtype, info[0].shape, label, True),
                    info[1],
                    info[2],
                )
            tensors[name] = info[0]
            spans.append((info[1], info[2], name))
    if not truncated and len(spans) == len(header) - ("__metadata__" in header):
        # The library requires the tensors' data to tile the buffer exactly, in offset order.
        position = 0
        for begin, end, name in sorted(spans):
            if begin != position:
                problems.append(
                    f"{label}: tensor data does not tile the file: `{name}` starts at byte "
                    f"{begin} of the data, expected {position} (overlap or gap)"
                )
                break
            position = end
        else:
            if position != data_len:
                problems.append(
                    f"{label}: the tensors cover {position} bytes of data but the file holds "
                    f"{data_len} after the header (truncated or padded)"
                )
    return tensors


def _end_offset(entry) -> int:
    """The end offset of a self-consistent header entry (its offsets span exactly its dtype and
    shape); 0 for any other entry (its own checks report it)."""
    if not isinstance(entry, dict):
        return 0
    offsets, shape = entry.get("data_offsets"), entry.get("shape")
    itemsize = DTYPE_BYTES.get(entry.get("dtype")) if isinstance(entry.get("dtype"), str) else None
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        and 0 <= offsets[0] <= offsets[1]
        and isinstance(shape, list)
        and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        return 0
    if itemsize is not None and math.prod(shape) * itemsize != offsets[1] - offsets[0]:
        return 0
    return offsets[1]


def _described_data_end(header: dict) -> int:
    """Where the data the header describes ends (bytes after the header)."""
    return max((_end_offset(e) for n, e in header.items() if n != "__metadata__"), default=0)


def _tensor_entry(name, entry, label, data_len, problems):
    where = f"{label}: tensor `{name}`"
    if not isinstance(entry, dict):
        problems.append(f"{where}: expected an object with dtype/shape/data_offsets")
        return None
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    bad = False
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        problems.append(f"{where}: unknown dtype {dtype!r}")
        bad = True
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        problems.append(f"{where}: shape must be a list of non-negative integers, found {shape!r}")
        bad = True
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= data_len
    ):
        problems.append(
            f"{where}: data_offsets must be [begin, end] with 0 <= begin <= end <= {data_len} "
            f"(the data size), found {offsets!r}"
        )
        bad = True
    if bad:
        return None
    itemsize = DTYPE_BYTES[dtype]
    nbytes = offsets[1] - offsets[0]
    if itemsize is not None and math.prod(shape) * itemsize != nbytes:
        problems.append(
            f"{where}: {dtype} {shape} needs {math.prod(shape) * itemsize} bytes but data_offsets "
            f"span {nbytes}"
        )
        return None
    return TensorInfo(name, dtype, tuple(shape), label), offsets[0], offsets[1]


def scan_checkpoint(directory: str) -> CheckpointScan:
    """Read every header of a checkpoint directory; never raises (problems are collected).

    ``model.safetensors.index.json`` (sharded) wins; else ``model.safetensors``; else every
    ``*.safetensors`` file in the directory.
    """
    directory = os.fspath(directory)
    problems: list[str] = []
    warnings: list[str] = []
    tensors: dict[str, TensorInfo] = {}
    index_path = os.path.join(directory, INDEX_FILE)
    index = None
    weight_map: dict[str, str] | None = None
    if os.path.isfile(index_path):
        index = INDEX_FILE
        weight_map = _read_index(index_path, problems)
        files = sorted(set(weight_map.values())) if weight_map else []
    elif os.path.isfile(os.path.join(directory, SINGLE_FILE)):
        files = [SINGLE_FILE]
    else:
        try:
            files = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
        except OSError as exc:
            problems.append(f"{directory}: cannot list ({exc.strerror or exc})")
            files = []
        if not files and not problems:
            problems.append(
                f"{directory}: no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors file (the draft's "
                "weights)"
            )
    per_file: dict[str, dict[str, TensorInfo]] = {}
    for name in files:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            listed = [t for t, f in (weight_map or {}).items() if f == name]
            problems.append(
                f"{INDEX_FILE} names shard {name!r} ({len(listed)} tensors, e.g. "
                f"`{listed[0]}`) but the file is missing"
                if listed
                else f"{name}: missing"
            )
            continue
        per_file[name] = _read_header(path, name, problems)
        for tensor, info in per_file[name].items():
            if tensor in tensors:
                problems.append(
                    f"tensor `{tensor}` is stored twice: in {tensors[tensor].file} and {name}"
                )
            else:
                tensors[tensor] = info
    if weight_map:
        for tensor, name in weight_map.items():
            if name in per_file and tensor not in per_file[name] and per_file[name]:
                problems.append(
                    f"{INDEX_FILE} puts `{tensor}` in {name} but that file has no such tensor"
                )
        unlisted = sorted(t for t in tensors if t not in weight_map)
        if unlisted:
            warnings.append(
                f"{len(unlisted)} tensor(s) in the shards are not listed in {INDEX_FILE}: "
                + name_list(unlisted)
            )
    return CheckpointScan(directory, tuple(files), index, tensors, tuple(problems), tuple(warnings))


def _read_index(path: str, problems: list[str]) -> dict[str, str]:
    try:
        with open(path, "rb") as f:
            index = json.loads(f.read().decode("utf-8"))
    except OSError as exc:
        problems.append(f"{INDEX_FILE}: cannot read ({exc.strerror or exc})")
        return {}
    except (ValueError, RecursionError) as exc:  # bad UTF-8, bad JSON, huge int literals
        problems.append(f"{INDEX_FILE}: not valid JSON ({exc.__class__.__name__}: {exc})"[:300])
        return {}
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        problems.append(
            f"{INDEX_FILE}: expected an object with a `weight_map` object "
            "(tensor name -> shard file)"
        )
        return {}
    good: dict[str, str] = {}
    for tensor, name in weight_map.items():
        if (
            not isinstance(name, str)
            or not name.endswith(".safetensors")
            or os.path.isabs(name)
            or os.path.normpath(name).startswith("..")
            or os.sep in os.path.normpath(name)
        ):
            problems.append(
                f"{INDEX_FILE}: `weight_map[{tensor!r}]` must be a .safetensors file name in the "
                f"checkpoint directory, found {name!r}"[:300]
            )
            continue
        good[tensor] = name
    return good


def name_list(names: list[str], limit: int = 8) -> str:
    """The first ``limit`` names, quoted, and how many more (for one-line problems)."""
    shown = ", ".join(f"`{n}`" for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


# --------------------------------------------------------------------------------------------
# Where a draft's headers come from: a local directory, a complete cache snapshot, the Hub.


@dataclass(frozen=True)
class HeaderSource:
    """A draft's safetensors headers and where they were read (``scan`` None: not read,
    ``where`` says why)."""

    scan: CheckpointScan | None
    where: str


def is_repo_id(model: str) -> bool:
    """Whether ``model`` names a Hugging Face repository rather than a local path."""
    return (
        not os.path.exists(model)
        and not model.startswith((".", "/", "~"))
        and re.fullmatch(r"[\w.-]+/[\w.-]+", model) is not None
    )


def cached_snapshot(repo_id: str, revision: str | None = None) -> str | None:
    """The local cache's snapshot directory of ``repo_id`` at ``revision`` (a branch, tag or
    commit; never downloads). Read from the cache layout directly: vLLM downloads only some of a
    repo's files, which ``snapshot_download(local_files_only=True)`` may call incomplete."""
    try:
        from huggingface_hub import constants
        from huggingface_hub.file_download import repo_folder_name
    except ImportError:
        return None
    storage = os.path.join(
        constants.HF_HUB_CACHE, repo_folder_name(repo_id=repo_id, repo_type="model")
    )
    ref = os.path.join(storage, "refs", revision or "main")
    commit = revision or "main"
    if os.path.isfile(ref):
        with open(ref) as f:
            commit = f.read().strip()
    snapshot = os.path.join(storage, "snapshots", commit)
    return snapshot if os.path.isdir(snapshot) else None


def pytorch_weight_files(directory: str) -> list[str]:
    """The PyTorch pickle weight files (``*.bin``, ``*.pt``, ``*.pth``) directly in
    ``directory``, which vLLM's default loader falls back to without safetensors files."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(n for n in names if n.endswith((".bin", ".pt", ".pth")))


def weights_present(directory: str) -> bool:
    """Whether ``directory`` holds a complete set of safetensors files (every shard an index
    names, or ``model.safetensors``, or some ``*.safetensors`` file without an index)."""
    index_path = os.path.join(directory, INDEX_FILE)
    if os.path.isfile(index_path):
        weight_map = _read_index(index_path, [])
        return bool(weight_map) and all(
            os.path.isfile(os.path.join(directory, f)) for f in set(weight_map.values())
        )
    try:
        return any(n.endswith(".safetensors") for n in os.listdir(directory))
    except OSError:
        return False


def draft_headers(model: str, revision: str | None = None, hub: bool = True) -> HeaderSource:
    """The draft's tensor headers from the first source that has them: a local directory, a
    complete snapshot in the Hugging Face cache, or (``hub`` and not ``HF_HUB_OFFLINE``) the
    Hub's safetensors metadata (``get_safetensors_metadata``: header byte ranges only, at
    ``revision``, with the saved token and ``HF_ENDPOINT``). Never downloads a weight."""
    if not is_repo_id(model):
        directory = model if os.path.isdir(model) else os.path.dirname(model) or "."
        return _directory_headers(directory, f"local directory {directory}")
    snapshot = cached_snapshot(model, revision)
    if snapshot is not None and (weights_present(snapshot) or pytorch_weight_files(snapshot)):
        return _directory_headers(snapshot, f"Hugging Face cache {snapshot}")
    from huggingface_hub import constants

    at = f"{model}@{revision or 'main'}"
    if constants.HF_HUB_OFFLINE or not hub:
        why = "HF_HUB_OFFLINE=1" if constants.HF_HUB_OFFLINE else "Hub not asked"
        return HeaderSource(None, f"{why} and the weights of {at} are not in the cache")
    return _hub_headers(model, revision, at)


def _directory_headers(directory: str, where: str) -> HeaderSource:
    """The headers of the checkpoint in ``directory``; none when it holds only PyTorch pickles
    (vLLM loads them when no safetensors file is there, but their tensor headers cannot be read
    without unpickling, so the check is left to load time)."""
    pickles = pytorch_weight_files(directory)
    if pickles and not weights_present(directory):
        return HeaderSource(
            None,
            f"{where} holds PyTorch weights ({name_list(pickles, 3)}), whose tensor headers cannot "
            "be read without loading them",
        )
    return HeaderSource(scan_checkpoint(directory), where)


def error_summary(exc: BaseException, limit: int = 160) -> str:
    """``Type: first line of the message`` (just ``Type`` for an empty message, e.g. a bare
    ``TimeoutError()``)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:limit]}" if lines else type(exc).__name__


def _hub_headers(model: str, revision: str | None, at: str) -> HeaderSource:
    from huggingface_hub import get_safetensors_metadata
    from huggingface_hub.errors import NotASafetensorsRepoError, SafetensorsParsingError

    where = f"Hub safetensors metadata of {at}"
    try:
        meta = get_safetensors_metadata(model, revision=revision)
    except NotASafetensorsRepoError:
        return HeaderSource(None, f"{at} lists no {SINGLE_FILE} or {INDEX_FILE} on the Hub")
    except SafetensorsParsingError as exc:
        scan = CheckpointScan(
            at, (), None, {}, (f"header unreadable on the Hub ({exc})"[:300],), ()
        )
        return HeaderSource(scan, where)
    except Exception as exc:  # unreachable Hub, unknown repo, gated, ...: vLLM says the rest
        return HeaderSource(
            None,
            f"the Hub's safetensors metadata of {at} could not be read ({error_summary(exc)})",
        )
    problems: list[str] = []
    tensors: dict[str, TensorInfo] = {}
    for name, file_meta in sorted(meta.files_metadata.items()):
        for tensor, t in file_meta.tensors.items():
            if tensor in tensors:
                problems.append(
                    f"tensor `{tensor}` is stored twice: in {tensors[tensor].file} and {name}"
                )
                continue
            tensors[tensor] = TensorInfo(tensor, t.dtype, tuple(t.shape), name)
    scan = CheckpointScan(
        at,
        tuple(sorted(meta.files_metadata)),
        INDEX_FILE if meta.sharded else None,
        tensors,
        tuple(problems),
        (),
    )
    return HeaderSource(scan, where)


# --------------------------------------------------------------------------------------------
# Config files: a local path, the Hugging Face cache, the Hub.


def load_config(
    model: str, what: str = "draft", revision: str | None = None, hub: bool = True
) -> tuple[dict, str]:
    """``model``'s config.json as a dict (with ModelOpt's ``hf_quant_config.json`` as its
    ``quantization_config`` when the config has none) and the file read.

    ``model`` is a local directory or JSON file, or a Hub id: read from the local cache at
    ``revision``, else (``hub`` and not offline) downloaded (config files only). Raises
    :class:`DraftSpecError` naming what is missing.
    """
    if not is_repo_id(model):
        cfg, file = read_config_json(model, what)
        quant = os.path.join(os.path.dirname(file), "hf_quant_config.json")
        if "quantization_config" not in cfg and os.path.isfile(quant):
            cfg = dict(cfg, quantization_config=read_config_json(quant, what)[0])
        return cfg, file
    file = _hub_file(model, "config.json", revision, hub)
    if file is None:
        from huggingface_hub import constants

        at = f"{model}@{revision or 'main'}"
        why = (
            " and the Hub is off (HF_HUB_OFFLINE=1)"
            if constants.HF_HUB_OFFLINE
            else " and the Hub did not provide it (unknown repository or revision, no "
            "access, or no connection)"
            if hub
            else ""
        )
        raise DraftSpecError(
            f"{what} {at}: config.json is not in the local Hugging Face cache" + why
        )
    cfg, file = read_config_json(file, what)
    if "quantization_config" not in cfg:
        quant = _hub_file(model, "hf_quant_config.json", revision, hub)
        if quant is not None:
            cfg = dict(cfg, quantization_config=read_config_json(quant, what)[0])
    return cfg, file


def _hub_file(repo_id: str, filename: str, revision: str | None, hub: bool) -> str | None:
    """A small file of a Hub repo: from the cache, else downloaded when the Hub is on."""
    try:
        from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache
    except ImportError:
        return None
    cached = try_to_load_from_cache(repo_id, filename, revision=revision)
    if isinstance(cached, str):
        return cached
    if not hub or constants.HF_HUB_OFFLINE or cached is not None:  # cached: known absent
        return None
    try:
        return hf_hub_download(repo_id, filename, revision=revision)
    except Exception:  # absent file, unknown repo, unreachable Hub
        return None
