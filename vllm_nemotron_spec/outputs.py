"""Writing command outputs without destroying what the command did not create.

Every command that writes a directory or a file builds it in a temporary sibling and moves it into
place at the end (:func:`atomic_output_dir`, :func:`atomic_output_file`): an interrupted run
leaves the old output, or nothing, and never a half-written checkpoint at the destination.

Before that, :func:`check_output_dir` decides whether the destination may be replaced: only an
empty directory or one holding exactly files the tool wrote before (its manifest lists them). It
never replaces ``/``, the home directory, the working directory, the source, or a directory
containing any of them, and refuses anything it does not recognise. Each refusal is an
:class:`OutputError` whose message is one line naming the path and the reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

OUTPUT_MANIFEST = ".vllm-nemotron-spec-output.json"
"""Written into every output directory that has no manifest of its own (``quantize``): the files
the tool wrote, so a later ``--force`` can tell them from files it must not delete."""


class OutputError(ValueError):
    """The destination cannot be written or replaced; the message is one line naming it."""


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _protected(extra: Iterable[str | Path] = ()) -> list[tuple[Path, str]]:
    out = [(Path("/"), "the root directory"), (Path.cwd().resolve(), "the working directory")]
    with contextlib.suppress(RuntimeError, KeyError):
        out.append((Path.home().resolve(), "the home directory"))
    out += [(Path(p).expanduser().resolve(), "the source") for p in extra]
    return out


def check_output_dir(
    dest: str | Path,
    *,
    recognised: Callable[[Path], set[str] | None],
    sources: Iterable[str | Path] = (),
    option: str | None = None,
) -> Path:
    """Check that ``dest`` may become (or be replaced by) a new output directory; return it
    resolved. Raise :class:`OutputError` when it is a file or a symbolic link, when it is, or
    contains, ``/``, the home directory, the working directory or one of ``sources``, or when it
    is not empty and holds a file that ``recognised(dest)`` (relative POSIX paths the tool wrote
    there, or None: nothing recognised) does not list. ``option`` (the command's ``--force``) is
    named in the messages."""
    given = Path(dest).expanduser()
    if given.is_symlink():
        raise OutputError(
            f"{given} is a symbolic link; refusing to replace it: give the real "
            f"directory or a new path"
        )
    path = given.resolve()
    protected = _protected(sources)
    for place, what in protected:
        if path == place:
            raise OutputError(
                f"{path} is {what}; refusing to write there: choose a new or empty directory"
            )
    for place, what in protected:
        if path in place.parents:
            raise OutputError(
                f"{path} contains {place}, {what}; refusing to write there: "
                f"choose a new or empty directory"
            )
    if not path.exists():
        return path
    if not path.is_dir():
        raise OutputError(f"{path} exists and is not a directory; refusing to replace it")
    if not any(path.iterdir()):
        return path
    even = f", even with {option}" if option else ""
    known = recognised(path)
    if known is None:
        raise OutputError(
            f"{path} is not empty and was not written by this command (no "
            f"manifest); refusing to replace it{even}: choose a new or empty "
            f"directory"
        )
    foreign = first_foreign_file(path, known)
    if foreign is not None:
        raise OutputError(
            f"{path} holds {foreign}, which this command did not write; refusing "
            f"to replace it{even}: move that file or choose a new directory"
        )
    return path


def first_foreign_file(root: Path, known: set[str]) -> str | None:
    """The first file (or link, or other non-directory) under ``root`` whose relative POSIX path
    is not in ``known``, or None."""
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        for name in sorted(filenames) + sorted(
            d for d in dirnames if os.path.islink(os.path.join(dirpath, d))
        ):
            rel = (rel_dir / name).as_posix()
            if rel not in known:
                return rel
        dirnames[:] = sorted(d for d in dirnames if not os.path.islink(os.path.join(dirpath, d)))
    return None


def manifest_files(manifest: str = OUTPUT_MANIFEST) -> Callable[[Path], set[str] | None]:
    """A ``recognised`` function for :func:`check_output_dir`: the keys of ``files`` in the JSON
    ``manifest`` of the directory, plus the manifest itself; None when there is none."""

    def recognised(path: Path) -> set[str] | None:
        try:
            files = json.loads((path / manifest).read_text()).get("files")
        except (OSError, ValueError, AttributeError):
            return None
        if not isinstance(files, (dict, list)):
            return None
        return {str(f) for f in files} | {manifest}

    return recognised


def write_manifest(directory: Path, command: str, manifest: str = OUTPUT_MANIFEST) -> None:
    """Record every file under ``directory`` (name -> size) as written by ``command``."""
    files = {
        p.relative_to(directory).as_posix(): p.stat().st_size
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != manifest
    }
    (directory / manifest).write_text(
        json.dumps(
            {"written_by": f"vllm-nemotron-spec {command}", "files": files},
            indent=2,
            sort_keys=True,
        )
        + "\n"
    )


def replace_dir(tmp: Path, dest: Path) -> None:
    """Move the finished directory ``tmp`` to ``dest`` (a sibling), replacing an older ``dest``:
    the old one is renamed aside first and deleted only once the new one is in place."""
    old = None
    if dest.exists() or dest.is_symlink():
        old = dest.with_name(f".{dest.name}.old-{os.getpid()}-{time.time_ns()}")
        os.replace(dest, old)
    os.replace(tmp, dest)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_output_dir(dest: str | Path) -> Iterator[Path]:
    """Yield an empty temporary directory next to ``dest`` (usual permissions); when the block
    completes it replaces ``dest`` (:func:`replace_dir`); on any exception it is deleted and
    ``dest`` is left as it was. Check ``dest`` with :func:`check_output_dir` first."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        tmp.chmod(0o777 & ~_umask())  # mkdtemp makes it 0700
        yield tmp
        replace_dir(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


FILE_SIGNATURES = {".png": b"\x89PNG\r\n\x1a\n", ".pdf": b"%PDF"}
"""What a file this project writes starts with, by suffix: an existing destination file is
replaced only when it starts the same way."""


def check_output_file(dest: str | Path) -> Path:
    """Check that ``dest`` may be written as a file (:data:`FILE_SIGNATURES`); return it resolved.
    Raise :class:`OutputError` when it is a directory or an existing file of another kind."""
    path = Path(dest).expanduser().resolve()
    if path.is_dir():
        raise OutputError(f"{path} is a directory; give a file name")
    if path.exists():
        signature = FILE_SIGNATURES.get(path.suffix.lower())
        with open(path, "rb") as f:
            head = f.read(len(signature or b""))
        if signature is None or head != signature:
            kind = f"a {path.suffix.lstrip('.').upper()} file" if signature else "a file"
            raise OutputError(
                f"{path} exists and is not {kind} this command writes; refusing "
                f"to overwrite it: choose another name"
            )
    return path


@contextlib.contextmanager
def atomic_output_file(dest: str | Path) -> Iterator[Path]:
    """Yield a temporary path next to ``dest`` with the same suffix; when the block completes it
    replaces ``dest`` atomically (``os.replace``); on any exception it is deleted."""
    dest = check_output_file(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{dest.name}.tmp-", suffix=dest.suffix, dir=dest.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        tmp.chmod(0o666 & ~_umask())  # mkstemp makes it 0600
        yield tmp
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            tmp.unlink()
