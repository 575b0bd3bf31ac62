"""Build (or reuse) the tiny Nemotron-3.5-shaped family: tokenizer, target, DFlash and DSpark drafts.

Everything derives from the seed (corpus, tokenizer, target init and training, draft init), so
the same seed gives byte-identical files on the same machine type. A complete family with the
same seed, builder code and parameter hash is reused without rebuilding (:mod:`.cache`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vllm_nemotron_spec.checkpoint.layout import DFLASH, DSPARK
from vllm_nemotron_spec.tiny import cache
from vllm_nemotron_spec.tiny.cache import MANIFEST
from vllm_nemotron_spec.tiny.corpus import CorpusParams
from vllm_nemotron_spec.tiny.drafts import DraftParams
from vllm_nemotron_spec.tiny.target import TargetParams
from vllm_nemotron_spec.tiny.tokenizer import TokenizerParams

BUILDER_SOURCES = ("tiny/*.py", "checkpoint/layout.py", "nvfp4/format.py", "_torch.py")
"""The package files whose code decides what the family and the trained drafts contain (globs
relative to the package). Their content hashes key the caches, so a changed builder never reuses
an artifact built by older code."""

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
CACHE_ENV = "NEMOTRON_SPEC_CACHE"


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
    """``$NEMOTRON_SPEC_CACHE``, default ``~/.cache/vllm-nemotron-spec``."""
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
    """Build the tiny family of ``seed`` into ``outdir`` (or reuse a matching complete one)::

        outdir/manifest.json   seed, hash of the builder's code and of its parameters, file hashes
        outdir/tokenizer/      the byte-level BPE tokenizer (also copied into each model directory)
        outdir/target/         NemotronHForCausalLM (fp32 safetensors) + tokenizer files
        outdir/dflash/         DFlashDraftModel, W4A16 NVFP4 layout + tokenizer files
        outdir/dspark/         Qwen3DSparkModel, W4A16 NVFP4 layout + tokenizer files

    Reuse goes through :mod:`.cache` (file lock, temporary sibling moved into place, a stale
    family replaced only when it holds nothing but the files of its manifest). ``force`` rebuilds even when a matching family is present. ``spec`` overrides the default
    parameters (tests use a reduced spec); it is part of the cache key.
    """
    spec = spec or TinySpec()
    seed = int(seed)
    root = cache.cached_build(
        outdir,
        lambda tmp: _build_into(tmp, seed, spec, progress),
        lambda path: is_complete(path, seed, spec),
        force=force,
        option="--force" if force else None,
        what="tiny family",
    )
    return TinyFamily.at(root)


def is_complete(outdir: str | Path, seed: int, spec: TinySpec | None = None) -> bool:
    """Whether ``outdir`` holds a complete family built with ``seed``, this builder version and
    these parameters (every file of the manifest present with its recorded size)."""
    spec = spec or TinySpec()
    return cache.is_complete(outdir, _identity(seed, spec), REQUIRED_FILES)


def _identity(seed: int, spec: TinySpec) -> dict:
    """The manifest fields that must match for a family to be reused."""
    return {
        "builder_sources": builder_source_hash(),
        "seed": seed,
        "params_hash": spec.params_hash(),
    }


def _build_into(root: Path, seed: int, spec: TinySpec, progress: bool) -> dict:
    """Write the family of ``seed`` into ``root``; returns its manifest fields (the file table is
    added by :func:`.cache.cached_build`)."""
    from vllm_nemotron_spec._torch import deterministic_torch
    from vllm_nemotron_spec.tiny import drafts, target, tokenizer
    from vllm_nemotron_spec.tiny.corpus import generate_documents

    t0 = time.monotonic()
    cache.say(progress, f"building tiny Nemotron-3.5 family (seed {seed}) in {root.parent}")
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
    cache.say(
        progress,
        f"built tiny family in {time.monotonic() - t0:.0f} s (target loss "
        f"{stats['first_loss']:.2f} -> {stats['final_loss']:.2f})",
    )
    return {**_identity(seed, spec), "params": spec.to_dict(), "target_training": stats}
