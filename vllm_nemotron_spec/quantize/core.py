"""Quantize a BF16 draft into the official W4A16 NVFP4 layout: read and check, pack, write.

:func:`quantize_draft` reads the BF16 draft (config.json parsed by :class:`DraftSpec`, every tensor
checked against the shapes it implies), packs the modules the Nemotron 3.5 layout quantizes
(:func:`~vllm_nemotron_spec.checkpoint.layout.is_nvfp4_module`) with the chosen engine, writes
the checkpoint and its quantization config into a temporary directory moved into place
(:mod:`vllm_nemotron_spec.outputs`), and checks the result the way ``inspect`` does.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from vllm_nemotron_spec.checkpoint import layout
from vllm_nemotron_spec.quantize import ENGINES

DEFAULT_MAX_SHARD_SIZE = "5GB"
WEIGHT_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
SKIPPED_FILES = (
    "config.json",
    "hf_quant_config.json",
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
)


class QuantizeError(ValueError):
    """The source draft or the request cannot be quantized; ``problems`` lists every reason."""

    def __init__(self, problems, source: str | None = None):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.source = source
        head = f"{source}: " if source else ""
        if len(self.problems) == 1:
            message = head + self.problems[0]
        else:
            message = (
                head
                + f"{len(self.problems)} problems:\n"
                + "\n".join(f"  - {p}" for p in self.problems)
            )
        super().__init__(message)


@dataclass
class SourceDraft:
    path: Path
    config: dict
    spec: object  # DraftSpec
    kind: str  # "dflash" / "dspark"
    tensors: dict  # checkpoint name (no "model." prefix) -> tensor, as stored
    extra_files: list[Path]
    warnings: list[str] = field(default_factory=list)


@dataclass
class QuantizeResult:
    outdir: Path
    kind: str
    engine: str  # description, e.g. "modelopt 0.47.0 (in /x/bin/python)"
    engine_info: dict
    packed_modules: list[str]
    bf16_tensors: list[str]
    files: list[str]
    total_bytes: int
    source_bytes: int
    warnings: list[str]

    def to_dict(self) -> dict:
        return {
            "outdir": str(self.outdir),
            "kind": self.kind,
            "engine": self.engine,
            "engine_info": self.engine_info,
            "packed_modules": self.packed_modules,
            "bf16_tensors": self.bf16_tensors,
            "files": self.files,
            "total_bytes": self.total_bytes,
            "source_bytes": self.source_bytes,
            "warnings": self.warnings,
        }


# ---------------------------------------------------------------------------------------------
# Reading the source draft
# ---------------------------------------------------------------------------------------------


def nvfp4_modules(spec) -> list[str]:
    """The draft's linear modules that the Nemotron 3.5 layout stores NVFP4, in checkpoint order."""

    return [name for name, _ in spec.linear_modules() if layout.is_nvfp4_module(name)]


def expected_tensors(spec) -> dict[str, tuple[int, ...]]:
    """Every tensor of the BF16 draft: checkpoint name -> logical shape."""
    out = {f"{name}.weight": tuple(shape) for name, shape in spec.linear_modules()}
    out.update((name, tuple(shape)) for name, shape in spec.dense_tensors())
    return out


def load_source(path: str | Path) -> SourceDraft:
    """Read and check the BF16 draft at ``path`` (see the module doc); raises
    :class:`QuantizeError` listing every problem."""
    import torch

    from vllm_nemotron_spec.checkpoint.spec import DraftSpec, DraftSpecError
    from vllm_nemotron_spec.quantize.safetensors_io import read_tensors

    path = Path(path).expanduser()
    if path.is_file() and path.name == "config.json":
        path = path.parent
    if not (path / "config.json").is_file():
        raise QuantizeError(f"no config.json in {path} (expected a draft checkpoint directory)")
    config = json.loads((path / "config.json").read_text())
    problems: list[str] = []
    if config.get("quantization_config") or (path / "hf_quant_config.json").is_file():
        q = config.get("quantization_config") or {}
        what = q.get("quant_algo") or q.get("quant_method") or "hf_quant_config.json"
        raise QuantizeError(
            f"the draft is already quantized ({what}); quantize takes a BF16 (unquantized) draft",
            source=str(path),
        )
    try:
        spec = DraftSpec.from_config(config, path=str(path))
    except DraftSpecError as exc:
        raise QuantizeError([f"config.json: {p}" for p in exc.problems], source=str(path)) from None
    warnings = [f"config.json: {w}" for w in spec.warnings]
    if not spec.is_nemotron35:
        warnings.append(
            "config.json does not have the Nemotron 3.5 draft layout (own embed_tokens, the "
            "target's lm_head, eagle_aux_hidden_state_layer_ids, dflash_config); packing it with "
            "the same rules (fc and MLP linears NVFP4)"
        )
    try:
        raw = read_tensors(path)
    except (FileNotFoundError, ValueError) as exc:
        raise QuantizeError(str(exc), source=str(path)) from None

    expected = expected_tensors(spec)
    tensors: dict[str, torch.Tensor] = {}
    for key, value in raw.items():
        name = key[len("model.") :] if key.startswith("model.") and key not in expected else key
        if name in tensors:
            problems.append(f"tensor {name} is stored twice (as {name} and model.{name})")
            continue
        tensors[name] = value
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing:
        problems.append(f"missing tensor(s) the config implies: {_list(missing)}")
    if unexpected:
        problems.append(
            f"tensor(s) the config does not imply: {_list(unexpected)} (a DFlash / DSpark draft "
            "stores fc, hidden_norm, norm, embed_tokens, layers.N.* and, for DSpark, markov_head.*)"
        )
    for name, shape in expected.items():
        value = tensors.get(name)
        if value is None:
            continue
        if not value.is_floating_point():
            problems.append(f"tensor {name}: {value.dtype}, expected an unquantized float tensor")
        elif tuple(value.shape) != shape:
            problems.append(
                f"tensor {name}: shape {list(value.shape)}, the config implies {list(shape)}"
            )
        elif not bool(torch.isfinite(value).all()):
            problems.append(f"tensor {name}: contains inf / nan")
    for module in nvfp4_modules(spec):
        shape = expected[f"{module}.weight"]
        if shape[1] % 16:
            problems.append(
                f"{module}: NVFP4 needs in_features divisible by 16, logical shape {list(shape)}"
            )
    if problems:
        raise QuantizeError(problems, source=str(path))
    non_bf16 = sorted({str(v.dtype).replace("torch.", "") for v in tensors.values()} - {"bfloat16"})
    if non_bf16:
        warnings.append(
            f"tensors stored as {', '.join(non_bf16)} are rounded to bfloat16 (the "
            "packed modules are quantized from their bfloat16 values, as ModelOpt's "
            "export does)"
        )
    extra = [
        p
        for p in sorted(path.iterdir())
        if p.is_file() and p.name not in SKIPPED_FILES and not p.name.endswith(WEIGHT_FILE_SUFFIXES)
    ]
    return SourceDraft(path, config, spec, spec.method, tensors, extra, warnings)


def _list(names: list[str], limit: int = 10) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


# ---------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------


def output_configs(source: SourceDraft, producer_version: str) -> tuple[dict, dict]:
    """(config.json, hf_quant_config.json) of the quantized draft, as ModelOpt exports them."""

    quant = layout.quantization_config(source.kind)
    quant["producer"]["version"] = producer_version
    hf_quant = layout.hf_quant_config(source.kind)
    hf_quant["producer"]["version"] = producer_version
    config = dict(source.config)
    config["quantization_config"] = quant
    config["torch_dtype"] = "bfloat16"  # every unpacked tensor is written in BF16
    return dict(sorted(config.items())), hf_quant


def check_configs_match_layout(config: dict, packed: list[str], spec) -> None:
    """The written config must quantize exactly the packed modules (a bug otherwise)."""
    from vllm_nemotron_spec.checkpoint.spec import DraftSpec

    out_spec = DraftSpec.from_config(config)
    wrong = [
        name for name, _ in spec.linear_modules() if out_spec.is_quantized(name) != (name in packed)
    ]
    if wrong:
        raise AssertionError(f"quantization_config and the packed tensors disagree on {wrong}")


# ---------------------------------------------------------------------------------------------
# The pipeline
# ---------------------------------------------------------------------------------------------


def make_engine(engine: str, modelopt_python: str | None = None):
    if engine == "builtin":
        from vllm_nemotron_spec.quantize.builtin import BuiltinEngine

        return BuiltinEngine()
    if engine == "modelopt":
        from vllm_nemotron_spec.quantize.modelopt_engine import resolve_engine

        return resolve_engine(modelopt_python)
    raise QuantizeError(f"unknown engine {engine!r}; choose one of {ENGINES}")


def quantize_draft(
    source_path: str | Path,
    outdir: str | Path,
    engine: str = "builtin",
    *,
    modelopt_python: str | None = None,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    force: bool = False,
    progress: bool = True,
) -> QuantizeResult:
    """Quantize the BF16 draft at ``source_path`` into ``outdir`` (module doc)."""
    import torch

    from vllm_nemotron_spec.outputs import (
        OutputError,
        atomic_output_dir,
        check_output_dir,
        manifest_files,
        write_manifest,
    )
    from vllm_nemotron_spec.quantize.safetensors_io import parse_size, write_shards

    max_bytes = parse_size(max_shard_size)
    source_path = Path(source_path).expanduser()
    try:
        outdir = check_output_dir(
            outdir, recognised=manifest_files(), sources=[source_path], option="--force"
        )
    except OutputError as exc:
        raise QuantizeError(str(exc)) from None
    if not force and outdir.exists() and any(outdir.iterdir()):
        raise QuantizeError(f"{outdir} exists and is not empty; pass --force to replace it")
    eng = make_engine(engine, modelopt_python)
    if hasattr(eng, "check_available"):
        eng.check_available()
    source = load_source(source_path)
    for w in source.warnings:
        _say(progress, f"warning: {w}")
    spec = source.spec
    modules = nvfp4_modules(spec)
    _say(
        progress,
        f"{source.kind} draft {source.path}: {len(source.tensors)} tensors, "
        f"{len(modules)} NVFP4 modules; engine {eng.describe()}",
    )

    bf16 = {k: v.to(torch.bfloat16) for k, v in source.tensors.items()}
    packed = eng.pack(bf16, modules, progress=progress)
    packed_weights = {f"{m}.weight" for m in modules}
    tensors = dict(packed)
    tensors.update((k, v) for k, v in bf16.items() if k not in packed_weights)
    tensors = {k: tensors[k].contiguous() for k in sorted(tensors)}

    config, hf_quant = output_configs(source, eng.producer_version)
    check_configs_match_layout(config, modules, spec)

    with atomic_output_dir(outdir) as tmp:
        files = write_shards(
            tensors, tmp, max_shard_bytes=max_bytes, metadata={"format": "pt"}, progress=progress
        )
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "hf_quant_config.json", hf_quant)
        for f in source.extra_files:
            shutil.copy2(f, tmp / f.name)
        _check_written(tmp)
        write_manifest(tmp, "quantize")
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    source_bytes = sum(t.numel() * t.element_size() for t in bf16.values())
    result = QuantizeResult(
        outdir=outdir,
        kind=source.kind,
        engine=eng.describe(),
        engine_info=eng.info(),
        packed_modules=modules,
        bf16_tensors=sorted(k for k in bf16 if k not in packed_weights),
        files=sorted(
            files + ["config.json", "hf_quant_config.json"] + [f.name for f in source.extra_files]
        ),
        total_bytes=total,
        source_bytes=source_bytes,
        warnings=list(source.warnings),
    )
    return result


def _check_written(directory: Path) -> None:
    """The quantized checkpoint, checked as ``inspect`` and the server check it (headers only)."""
    from vllm_nemotron_spec.checkpoint.check import check_draft

    problems = check_draft(str(directory)).problems
    if problems:
        raise AssertionError(
            "the written checkpoint fails inspect:\n" + "\n".join(f"  - {p}" for p in problems)
        )


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _say(progress: bool, message: str) -> None:
    if progress:
        print(message, file=sys.stderr, flush=True)


def human_bytes(n: int) -> str:
    if n <= 0:
        return "0 B"
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    k = min(int(math.log(n, 1024)), len(units) - 1)
    return f"{n / 1024**k:.1f} {units[k]}" if k else f"{n} B"
