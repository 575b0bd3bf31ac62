"""Build (or reuse) the tiny Nemotron-3.5-shaped family: tokenizer, target, DFlash and DSpark drafts.

``build_tiny_family(outdir, seed)`` writes::

    outdir/manifest.json   seed, hash of the builder's code and of its parameters, file hashes
    outdir/tokenizer/      the byte-level BPE tokenizer (also copied into each model directory)
    outdir/target/         NemotronHForCausalLM (fp32 safetensors) + tokenizer files
    outdir/dflash/         DFlashDraftModel, W4A16 NVFP4 layout + tokenizer files
    outdir/dspark/         Qwen3DSparkModel, W4A16 NVFP4 layout + tokenizer files

Everything derives from the seed (corpus, tokenizer, target init and training, draft init), so
the same seed gives byte-identical files on the same machine type. A complete family with the
same seed, builder code and parameter hash is reused without rebuilding; a stale one is replaced
only when it holds nothing but the files of its manifest. Builds go to a temporary sibling
directory moved into place (:mod:`vllm_nemotron_spec.outputs`), under a file lock, so concurrent
test sessions sharing the cache neither race nor see half-written families.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vllm_nemotron_spec.checkpoint.layout import DFLASH, DSPARK
from vllm_nemotron_spec.outputs import atomic_output_dir, check_output_dir, manifest_files
from vllm_nemotron_spec.tiny.corpus import CorpusParams
from vllm_nemotron_spec.tiny.drafts import DraftParams
from vllm_nemotron_spec.tiny.target import TargetParams
from vllm_nemotron_spec.tiny.tokenizer import TokenizerParams

BUILDER_SOURCES = ("tiny/*.py", "checkpoint/layout.py", "nvfp4/format.py", "_torch.py")
"""The package files whose code decides what the family and the trained drafts contain (globs
relative to the package). Their content hashes key the caches, so a changed builder never reuses
an artifact built by older code."""

MANIFEST = "manifest.json"
REQUIRED_FILES = tuple(
    f"{d}/{f}"
    for d, names in {
        "tokenizer": ("tokenizer.json", "tokenizer_config.json"),
        "target": ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"),
        DFLASH: ("config.json", "hf_quant_config.json", "model.safetensors", "tokenizer.json"),
        DSPARK: ("config.json", "hf_quant_config.json", "model.safetensors", "tokenizer.json"),
    }.items()
    for f in names
)
CACHE_ENV = "VLLM_NEMOTRON_SPEC_CACHE"


@dataclass(frozen=True)
class TinyFamily:
    """Paths of a built family; each model directory also holds the tokenizer files."""

    root: Path
    tokenizer: Path  # tokenizer.json / tokenizer_config.json / special_tokens_map.json only
    target: Path
    dflash_draft: Path
    dspark_draft: Path

    @classmethod
    def at(cls, root: str | Path) -> "TinyFamily":
        root = Path(root)
        return cls(
            root=root,
            tokenizer=root / "tokenizer",
            target=root / "target",
            dflash_draft=root / DFLASH,
            dspark_draft=root / DSPARK,
        )

    def draft(self, kind: str) -> Path:
        return {DFLASH: self.dflash_draft, DSPARK: self.dspark_draft}[kind]

    def manifest(self) -> dict:
        return json.loads((self.root / MANIFEST).read_text())


@dataclass(frozen=True)
class TinySpec:
    """Every parameter of the build; its hash (with the seed) keys the cache."""

    corpus: CorpusParams = field(default_factory=CorpusParams)
    tokenizer: TokenizerParams = field(default_factory=TokenizerParams)
    target: TargetParams = field(default_factory=TargetParams)
    draft: DraftParams = field(default_factory=DraftParams)

    def to_dict(self) -> dict:
        return asdict(self)

    def params_hash(self) -> str:
        blob = json.dumps(
            {"builder_sources": builder_source_hash(), "spec": self.to_dict()}, sort_keys=True
        ).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


@functools.cache
def builder_source_hash() -> str:
    """SHA-256 (16 hex digits) over the names and bytes of the ``BUILDER_SOURCES`` files."""
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for pattern in BUILDER_SOURCES:
        for path in sorted(package.glob(pattern)):
            digest.update(path.relative_to(package).as_posix().encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def default_cache_dir() -> Path:
    """``$VLLM_NEMOTRON_SPEC_CACHE``, default ``~/.cache/vllm-nemotron-spec``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "vllm-nemotron-spec"


def ensure_tiny_family(seed: int = 0) -> TinyFamily:
    """The family of ``seed`` in the cache (``default_cache_dir()/tiny-family-seed{seed}``), built
    on first use."""
    return build_tiny_family(default_cache_dir() / f"tiny-family-seed{seed}", seed=seed)


def build_tiny_family(
    outdir: str | Path,
    seed: int = 0,
    force: bool = False,
    *,
    spec: TinySpec | None = None,
    progress: bool = True,
) -> TinyFamily:
    """Build the tiny family of ``seed`` into ``outdir`` (or reuse a matching complete one).

    ``force`` rebuilds even when a matching family is present. ``spec`` overrides the default
    parameters (tests use a reduced spec); it is part of the cache key.
    """
    spec = spec or TinySpec()
    outdir = Path(outdir).expanduser().resolve()
    seed = int(seed)
    if not force and is_complete(outdir, seed, spec):
        return TinyFamily.at(outdir)
    check_family_dir(outdir, option="--force" if force else None)
    outdir.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(outdir.parent / f".{outdir.name}.lock"):
        # Another process may have built it while we waited for the lock.
        if not force and is_complete(outdir, seed, spec):
            return TinyFamily.at(outdir)
        with atomic_output_dir(outdir) as tmp:
            _build_into(tmp, seed, spec, progress)
            _make_readable(tmp)
    if not is_complete(outdir, seed, spec):
        raise RuntimeError(f"tiny family in {outdir} is incomplete right after building it")
    return TinyFamily.at(outdir)


def _make_readable(root: Path) -> None:
    """mkdtemp and some writers create owner-only files; give the family the usual modes (umask
    respected) so a shared cache is readable."""
    umask = os.umask(0)
    os.umask(umask)
    root.chmod(0o777 & ~umask)
    for path in root.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def check_family_dir(outdir: str | Path, option: str | None = None) -> Path:
    """``outdir`` resolved, if a family may be built there: new, empty, or a (possibly stale)
    family holding only the files its manifest lists; else :class:`~vllm_nemotron_spec.outputs.
    OutputError` (one line naming the path and why)."""
    return check_output_dir(outdir, recognised=manifest_files(MANIFEST), option=option)


def is_complete(outdir: str | Path, seed: int, spec: TinySpec | None = None) -> bool:
    """Whether ``outdir`` holds a complete family built with ``seed``, this builder version and
    these parameters (every file of the manifest present with its recorded size)."""
    spec = spec or TinySpec()
    outdir = Path(outdir)
    try:
        manifest = json.loads((outdir / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    if (
        manifest.get("builder_sources") != builder_source_hash()
        or manifest.get("seed") != seed
        or manifest.get("params_hash") != spec.params_hash()
    ):
        return False
    files = manifest.get("files") or {}
    if not all(rel in files for rel in REQUIRED_FILES):
        return False
    for rel, info in files.items():
        path = outdir / rel
        if not path.is_file() or path.stat().st_size != info.get("size"):
            return False
    return True


def _build_into(root: Path, seed: int, spec: TinySpec, progress: bool) -> None:
    from vllm_nemotron_spec._torch import deterministic_torch
    from vllm_nemotron_spec.tiny import drafts, target, tokenizer
    from vllm_nemotron_spec.tiny.corpus import generate_documents

    t0 = time.monotonic()
    _say(progress, f"building tiny Nemotron-3.5 family (seed {seed}) in {root.parent}")
    documents = generate_documents(seed, spec.corpus.num_docs)
    tok = tokenizer.train_tokenizer(documents, spec.tokenizer)
    tokenizer.save_tokenizer(tok, root / "tokenizer", spec.tokenizer)
    target_dir = root / "target"
    tokenizer.copy_tokenizer(root / "tokenizer", target_dir)
    stats = target.build_target(
        target_dir, tok, documents, spec.target, seed=seed, progress=progress
    )
    with deterministic_torch(1):
        for kind in (DFLASH, DSPARK):
            drafts.build_draft(root / kind, kind, target_dir, seed=seed, params=spec.draft)
    manifest = {
        "builder_sources": builder_source_hash(),
        "seed": seed,
        "params_hash": spec.params_hash(),
        "params": spec.to_dict(),
        "target_training": stats,
        "files": _file_table(root),
    }
    (root / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    _say(
        progress,
        f"built tiny family in {time.monotonic() - t0:.0f} s (target loss "
        f"{stats['first_loss']:.2f} -> {stats['final_loss']:.2f})",
    )


def _file_table(root: Path) -> dict:
    table = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        data = path.read_bytes()
        table[path.relative_to(root).as_posix()] = {
            "size": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
    return table


@contextlib.contextmanager
def _file_lock(path: Path):
    import fcntl

    with open(path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _say(progress: bool, message: str) -> None:
    if progress:
        print(message, file=sys.stderr, flush=True)
