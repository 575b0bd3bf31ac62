"""The one cached-build machinery of ``tiny/`` (:mod:`vllm_nemotron_spec.tiny.cache`), and the
trained drafts going through it like the family (the family's own cache is tested with real
builds in test_tiny_build.py)."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from vllm_nemotron_spec.outputs import OutputError
from vllm_nemotron_spec.tiny import cache

IDENTITY = {"key": "abc", "seed": 0}


def _build(calls: list, content: str = "weights"):
    def build(tmp: Path) -> dict:
        calls.append(tmp)
        (tmp / "model").mkdir()
        (tmp / "model" / "w.bin").write_text(content)
        return {**IDENTITY, "stats": {"loss": 1.5}}

    return build


def _complete(path: Path) -> bool:
    return cache.is_complete(path, IDENTITY, ["model/w.bin"])


def test_build_writes_the_manifest_and_is_reused(tmp_path):
    calls = []
    out = cache.cached_build(tmp_path / "b", _build(calls), _complete)
    assert out == (tmp_path / "b").resolve() and len(calls) == 1
    manifest = cache.read_manifest(out)
    assert manifest["key"] == "abc" and manifest["stats"] == {"loss": 1.5}
    assert list(manifest["files"]) == ["model/w.bin"]  # not the manifest itself
    assert manifest["files"]["model/w.bin"]["size"] == len("weights")
    assert cache.cached_build(out, _build(calls), _complete) == out and len(calls) == 1
    cache.cached_build(out, _build(calls, "new"), _complete, force=True)
    assert len(calls) == 2 and (out / "model" / "w.bin").read_text() == "new"
    umask = os.umask(0)
    os.umask(umask)  # the usual modes, not mkdtemp's owner-only ones: a shared cache is readable
    assert stat.S_IMODE((out / "model" / "w.bin").stat().st_mode) == 0o666 & ~umask
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask


@pytest.mark.parametrize("damage", ["identity", "missing", "truncated", "no_manifest"])
def test_incomplete_or_other_builds_are_not_reused(tmp_path, damage):
    calls = []
    out = cache.cached_build(tmp_path / "b", _build(calls), _complete)
    weights = out / "model" / "w.bin"
    if damage == "identity":
        manifest = cache.read_manifest(out)
        manifest["key"] = "other"
        (out / cache.MANIFEST).write_text(json.dumps(manifest))
    elif damage == "missing":
        weights.unlink()
    elif damage == "truncated":
        weights.write_text("weight")
    else:
        (out / cache.MANIFEST).unlink()
        shutil.rmtree(out / "model")  # an empty directory may be built into
    assert not _complete(out)
    cache.cached_build(out, _build(calls), _complete)
    assert len(calls) == 2 and _complete(out)


def test_required_files_and_an_empty_table_are_incomplete(tmp_path):
    (tmp_path / cache.MANIFEST).write_text(json.dumps({**IDENTITY, "files": {}}))
    assert not cache.is_complete(tmp_path, IDENTITY)
    (tmp_path / "a").write_text("x")
    (tmp_path / cache.MANIFEST).write_text(
        json.dumps({**IDENTITY, "files": cache.file_table(tmp_path)})
    )
    assert cache.is_complete(tmp_path, IDENTITY)
    assert not cache.is_complete(tmp_path, IDENTITY, ["b"])
    assert not cache.is_complete(tmp_path, {**IDENTITY, "seed": 1})


def test_foreign_files_are_never_replaced_and_a_failed_build_leaves_the_old(tmp_path):
    calls = []
    out = cache.cached_build(tmp_path / "b", _build(calls), _complete)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match="holds notes.txt"):
        cache.cached_build(out, _build(calls), _complete, force=True, option="--force")
    (out / "notes.txt").unlink()

    def failing(tmp: Path) -> dict:
        (tmp / "half").write_text("x")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        cache.cached_build(out, failing, _complete, force=True)
    assert _complete(out) and not (out / "half").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".b.lock", "b"]


def test_a_build_that_does_not_complete_is_an_error(tmp_path):
    with pytest.raises(RuntimeError, match="thing in .* is incomplete right after building it"):
        cache.cached_build(tmp_path / "b", lambda tmp: {}, _complete, what="thing")


class _Family:
    """The two things the trained drafts read of a family: its root and manifest."""

    def __init__(self, root: Path, sha: str):
        self.root = root
        self._manifest = {
            "params_hash": "p",
            "files": {"target/model.safetensors": {"sha256": sha}},
        }

    def manifest(self) -> dict:
        return self._manifest


def test_trained_drafts_use_the_same_cache(tmp_path, monkeypatch):
    from vllm_nemotron_spec.tiny import train_draft as td

    calls = []

    def fake_train(root, family, seed, spec, progress):
        calls.append(seed)
        (root / td.DSPARK).mkdir()
        (root / td.DSPARK / "model.safetensors").write_text("trained")
        return {"total_seconds": 0.0}

    monkeypatch.setattr(td, "_train_into", fake_train)
    family = _Family(tmp_path / "fam", "aaa")
    out = tmp_path / "trained"
    got = td.build_trained_drafts(out, family, 0, progress=False)
    assert got.dspark == out / td.DSPARK and calls == [0]
    manifest = got.manifest()
    assert manifest["key"] == td.cache_key(family, 0, td.TrainerSpec())
    assert manifest["stats"] == {"total_seconds": 0.0} and manifest["family"] == str(family.root)
    assert list(manifest["files"]) == [f"{td.DSPARK}/model.safetensors"]
    td.build_trained_drafts(out, family, 0, progress=False)
    assert calls == [0]  # reused
    td.build_trained_drafts(out, _Family(family.root, "bbb"), 0, progress=False)
    assert calls == [0, 0]  # the family's files changed: trained again
