"""The cached builds of ``tiny/`` (the family, the trained drafts): a directory with a manifest,
built once and reused while the manifest's identity fields still match.

A build runs under a file lock next to the destination, into a temporary sibling moved into place
(:func:`vllm_nemotron_spec.outputs.atomic_output_dir`), so concurrent sessions sharing the cache
neither race nor see half-built directories; a stale directory is replaced only when it holds
nothing but the files its manifest lists. The manifest records every file with its size and
SHA-256; a directory is complete when its identity fields match and every file is there with its
size. Torch-free.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from vllm_nemotron_spec.outputs import atomic_output_dir, check_output_dir, manifest_files

MANIFEST = "manifest.json"


def read_manifest(root: str | Path) -> dict | None:
    """The manifest of ``root``, or None when it is missing or unreadable."""
    try:
        manifest = json.loads((Path(root) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def is_complete(root: str | Path, identity: Mapping, required: Iterable[str] = ()) -> bool:
    """Whether ``root`` holds a build whose manifest carries ``identity`` (every key equal), lists
    every ``required`` file, and whose listed files (at least one) are all present with their
    recorded sizes."""
    manifest = read_manifest(root)
    if manifest is None or any(manifest.get(k) != v for k, v in identity.items()):
        return False
    files = manifest.get("files") or {}
    if not files or not all(rel in files for rel in required):
        return False
    root = Path(root)
    return all(
        (root / rel).is_file() and (root / rel).stat().st_size == info.get("size")
        for rel, info in files.items()
    )


def cached_build(
    outdir: str | Path,
    build: Callable[[Path], dict],
    complete: Callable[[Path], bool],
    *,
    force: bool = False,
    option: str | None = None,
    what: str = "build",
) -> Path:
    """``outdir`` resolved, built by ``build(tmp)`` unless ``complete(outdir)`` already (and not
    ``force``). ``build`` writes its files into ``tmp`` and returns the manifest's other fields
    (identity first); the file table is added here. ``option`` names the caller's ``--force`` in
    the refusal to replace a foreign directory; ``what`` names the build in errors."""
    outdir = Path(outdir).expanduser().resolve()
    if not force and complete(outdir):
        return outdir
    check_output_dir(outdir, recognised=manifest_files(MANIFEST), option=option)
    outdir.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(outdir.parent / f".{outdir.name}.lock"):
        if not force and complete(outdir):  # another process built it while we waited
            return outdir
        with atomic_output_dir(outdir) as tmp:
            manifest = dict(build(tmp))
            manifest["files"] = file_table(tmp)
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
            make_readable(tmp)
    if not complete(outdir):
        raise RuntimeError(f"{what} in {outdir} is incomplete right after building it")
    return outdir


def file_table(root: Path) -> dict:
    """``{relative path: {"size", "sha256"}}`` of every file under ``root`` but its manifest."""
    table = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel == MANIFEST:
            continue
        data = path.read_bytes()
        table[rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    return table


def make_readable(root: Path) -> None:
    """mkdtemp and some writers create owner-only files; give the build the usual modes (umask
    respected) so a shared cache is readable."""
    umask = os.umask(0)
    os.umask(umask)
    root.chmod(0o777 & ~umask)
    for path in root.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


@contextlib.contextmanager
def file_lock(path: Path):
    """An exclusive ``flock`` on ``path`` (created if missing) for the ``with`` block."""
    import fcntl

    with open(path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def say(progress: bool, message: str) -> None:
    """A progress line on stderr when ``progress``."""
    if progress:
        print(message, file=sys.stderr, flush=True)
