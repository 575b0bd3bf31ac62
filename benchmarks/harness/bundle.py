"""Bringing results and start-up caches back from the lent GPU machine, and the caches back in.

What comes back from a command is at most 8 files of 16 MiB each, at most two folders down
(``../shared/gpu/README.md``). So:

* :func:`bundle_results` puts a run's report (``<stem>.md``, ``<stem>.json``) and one tar.gz of
  the rest of its ``--out`` (logs, per-arm files; no traces) into a folder, the tar split into
  parts of :data:`PART_BYTES` when it is larger;
* :func:`pack_caches` tars the start-up caches (Humming's JIT kernels ``~/.humming``, vLLM's
  ``~/.cache/vllm/torch_compile_cache``, Triton's ``~/.triton``, FlashInfer's
  ``~/.cache/flashinfer`` where present) into parts of :data:`PART_BYTES` with a manifest
  (``caches.json``: the parts, their sizes and sha256), kept on the machine and brought back a
  few parts a command (over several commands when larger); :func:`restore_caches` unpacks them into
  ``$HOME`` on a fresh machine before any engine starts. The parts may arrive over several
  commands: each call copies the parts present into a staging folder and unpacks once all of
  them are there (and only once: a marker records it).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile
from pathlib import Path

PART_BYTES = 15 * 1000 * 1000
MAX_FILES = 8
CACHE_DIRS = (".humming", ".cache/vllm/torch_compile_cache", ".triton", ".cache/flashinfer")
MANIFEST = "caches.json"
STAGING = Path("/tmp/nemotron-spec-cache-parts")  # restore: the parts that have arrived
PACK_STAGING = Path("/tmp/nemotron-spec-cache-pack")  # pack: every part, on the GPU machine


def _files_in(dest: Path) -> int:
    return sum(1 for p in dest.rglob("*") if p.is_file()) if dest.is_dir() else 0


def split_into_parts(data: bytes, dest: Path, stem: str, part_bytes: int | None = None) -> list:
    """``data`` as ``<stem>`` (one part) or ``<stem>.part-00``, ``-01``, ... in ``dest``, each
    at most ``part_bytes`` (default :data:`PART_BYTES`)."""
    part_bytes = part_bytes or PART_BYTES
    dest.mkdir(parents=True, exist_ok=True)
    chunks = [data[i : i + part_bytes] for i in range(0, len(data), part_bytes)] or [b""]
    if len(chunks) == 1:
        path = dest / stem
        path.write_bytes(chunks[0])
        return [path]
    paths = []
    for i, chunk in enumerate(chunks):
        path = dest / f"{stem}.part-{i:02d}"
        path.write_bytes(chunk)
        paths.append(path)
    return paths


def _tar_gz(root: Path, members: list[Path], skip=lambda p: False) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        for member in members:
            if member.exists():
                tar.add(
                    member,
                    arcname=str(member.relative_to(root)),
                    filter=lambda info: None if skip(Path(info.name)) else info,
                )
    return buf.getvalue()


def bundle_results(out: Path, dest: Path, stem: str) -> list[Path]:
    """The report and a tar.gz of ``out`` (traces left out) in ``dest``; refuses to make
    ``dest`` hold more than :data:`MAX_FILES` files."""
    out, dest = Path(out), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for suffix in (".md", ".json"):
        src = out / f"{stem}{suffix}"
        if src.is_file():
            written.append(Path(shutil.copy2(src, dest / src.name)))
    data = _tar_gz(out.parent, [out], skip=lambda p: "traces" in p.parts)
    parts = split_into_parts(data, dest, f"{stem}-out.tgz")
    written += parts
    if _files_in(dest) > MAX_FILES:
        raise RuntimeError(
            f"{dest} would hold {_files_in(dest)} files; at most {MAX_FILES} come back from the "
            f"GPU machine (the {stem} report is in {out})"
        )
    return written


def pack_caches(
    dest: Path,
    home: Path | None = None,
    max_parts: int = 4,
    from_part: int = 0,
    staging: Path | None = None,
) -> dict:
    """The start-up caches as parts plus a manifest: packed into ``staging`` on the machine (from
    part 0: afresh), then parts ``from_part`` .. ``from_part + max_parts - 1`` and the manifest
    copied into ``dest``. A pack larger than one command can bring back comes back over several:
    ``next_part`` says where the next command starts (None: every part is out)."""
    if not 1 <= max_parts < MAX_FILES:
        raise ValueError(f"1 to {MAX_FILES - 1} parts a command (at most {MAX_FILES} files come "
                         "back, the manifest one of them)")  # fmt: skip
    staging = Path(staging or PACK_STAGING)
    if from_part == 0:
        home = Path(home or Path.home())
        present = [home / d for d in CACHE_DIRS if (home / d).is_dir()]
        if not present:
            return {"packed": False, "reason": f"no start-up caches under {home}"}
        data = _tar_gz(home, present)
        shutil.rmtree(staging, ignore_errors=True)
        parts = split_into_parts(data, staging, "caches.tgz")
        manifest = {
            "dirs": [str(p.relative_to(home)) for p in present],
            "bytes": len(data),
            "parts": [{"name": p.name, "bytes": p.stat().st_size,
                       "sha256": hashlib.sha256(p.read_bytes()).hexdigest()} for p in parts],
        }  # fmt: skip
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    elif (staging / MANIFEST).is_file():
        manifest = json.loads((staging / MANIFEST).read_text())
    else:
        return {"packed": False, "reason": f"no pack in {staging} to go on from (from part 0 "
                "first, on this machine)"}  # fmt: skip
    names = [p["name"] for p in manifest["parts"]]
    if not 0 <= from_part < len(names):
        return {"packed": False,
                "reason": f"part {from_part} asked for; the pack has parts 0-{len(names) - 1}"}  # fmt: skip
    chosen = names[from_part : from_part + max_parts]
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for name in [*chosen, MANIFEST]:
        shutil.copy2(staging / name, dest / name)
    after = from_part + len(chosen)
    return {"packed": True, **manifest, "copied": chosen,
            "next_part": after if after < len(names) else None}  # fmt: skip


def restore_caches(src: Path, home: Path | None = None, staging: Path = STAGING) -> str:
    """Stage the parts found in ``src`` and unpack them into ``home`` once all are there;
    returns what happened (one line)."""
    src, home = Path(src), Path(home or Path.home())
    manifest_path = src / MANIFEST
    if not manifest_path.is_file():
        return f"no {MANIFEST} in {src}: nothing to restore"
    manifest = json.loads(manifest_path.read_text())
    digest = hashlib.sha256(manifest_path.read_bytes()).hexdigest()[:16]
    marker = home / ".cache" / "nemotron-spec-caches-restored"
    if marker.is_file() and marker.read_text().strip() == digest:
        return "start-up caches already restored"
    staging.mkdir(parents=True, exist_ok=True)
    for part in manifest["parts"]:
        here = src / part["name"]
        staged = staging / part["name"]
        if here.is_file() and not staged.is_file():
            shutil.copy2(here, staged)
    missing = [
        p["name"]
        for p in manifest["parts"]
        if not (staging / p["name"]).is_file()
        or hashlib.sha256((staging / p["name"]).read_bytes()).hexdigest() != p["sha256"]
    ]
    if missing:
        return f"start-up caches: waiting for parts {missing} (staged in {staging})"
    data = b"".join((staging / p["name"]).read_bytes() for p in manifest["parts"])
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        tar.extractall(home, filter="data")
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(digest + "\n")
    os.sync()
    return f"start-up caches restored into {home}: {', '.join(manifest['dirs'])}"
