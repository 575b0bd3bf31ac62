"""Building the tiny family: determinism, the cache and its manifest."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from vllm_nemotron_spec.outputs import OutputError
from vllm_nemotron_spec.tiny import build
from vllm_nemotron_spec.tiny.build import TinyFamily, TinySpec, build_tiny_family
from vllm_nemotron_spec.tiny.corpus import CorpusParams
from vllm_nemotron_spec.tiny.target import TargetParams

# Same architecture and code path as the default family, but a small corpus and 3 training steps,
# so a build takes seconds.
QUICK = TinySpec(
    corpus=CorpusParams(num_docs=1500),
    target=dataclasses.replace(TargetParams(), train_steps=3, batch_size=2, seq_len=64),
)
MODEL_DIRS = ("target", "dflash", "dspark")


def _files(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def quick_builds(tmp_path_factory):
    base = tmp_path_factory.mktemp("quick")
    a = build_tiny_family(base / "a", seed=0, spec=QUICK, progress=False)
    b = build_tiny_family(base / "b", seed=0, spec=QUICK, progress=False)
    c = build_tiny_family(base / "c", seed=1, spec=QUICK, progress=False)
    return a, b, c


def test_layout(quick_builds):
    fam = quick_builds[0]
    assert isinstance(fam, TinyFamily)
    for path in (fam.root, fam.tokenizer, fam.target, fam.dflash_draft, fam.dspark_draft):
        assert isinstance(path, Path) and path.is_dir()
    assert fam.target == fam.root / "target" and fam.tokenizer == fam.root / "tokenizer"
    assert fam.dflash_draft == fam.root / "dflash" and fam.dspark_draft == fam.root / "dspark"
    for name in MODEL_DIRS:
        d = fam.root / name
        for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            assert (d / f).is_file(), f"{name}/{f} missing"
    for kind in ("dflash", "dspark"):
        assert (fam.draft(kind) / "hf_quant_config.json").is_file()


def test_same_seed_gives_identical_bytes(quick_builds):
    a, b, _ = quick_builds
    fa, fb = _files(a.root), _files(b.root)
    assert sorted(fa) == sorted(fb)
    for name in fa:
        assert fa[name] == fb[name], f"{name} differs between two builds with seed 0"


def test_different_seed_gives_different_weights(quick_builds):
    a, _, c = quick_builds
    for name in MODEL_DIRS:
        wa = (a.root / name / "model.safetensors").read_bytes()
        wc = (c.root / name / "model.safetensors").read_bytes()
        assert wa != wc, f"{name} weights are the same for seeds 0 and 1"
    assert a.manifest()["seed"] == 0 and c.manifest()["seed"] == 1


def test_manifest(quick_builds):
    fam = quick_builds[0]
    m = fam.manifest()
    assert m["builder_sources"] == build.builder_source_hash()
    assert m["params_hash"] == QUICK.params_hash() != TinySpec().params_hash()
    assert m["params"] == QUICK.to_dict()
    files = _files(fam.root)
    files.pop("manifest.json")
    assert sorted(m["files"]) == sorted(files)
    for name, data in files.items():
        assert m["files"][name]["size"] == len(data)


def test_reuse_without_rebuilding(quick_builds, monkeypatch):
    fam = quick_builds[0]

    def fail(*args, **kwargs):
        raise AssertionError("rebuilt a complete family")

    monkeypatch.setattr(build, "_build_into", fail)
    again = build_tiny_family(fam.root, seed=0, spec=QUICK, progress=False)
    assert again == fam
    assert build.is_complete(fam.root, 0, QUICK)
    assert not build.is_complete(fam.root, 1, QUICK)  # other seed
    assert not build.is_complete(fam.root, 0, TinySpec())  # other parameters
    monkeypatch.setattr(build, "builder_source_hash", lambda: "0" * 16)
    assert not build.is_complete(fam.root, 0, QUICK)  # other builder code


def test_builder_source_hash_follows_the_code(tmp_path, monkeypatch):
    """The cache key changes when any builder source file changes, and only then."""
    package = tmp_path / "pkg"
    (package / "tiny").mkdir(parents=True)
    (package / "nvfp4").mkdir()
    (package / "tiny" / "build.py").write_text("a = 1\n")
    (package / "nvfp4" / "format.py").write_text("b = 2\n")
    (package / "other.py").write_text("c = 3\n")
    monkeypatch.setattr(build, "__file__", str(package / "tiny" / "build.py"))

    def digest() -> str:
        build.builder_source_hash.cache_clear()
        return build.builder_source_hash()

    try:
        first = digest()
        assert digest() == first
        (package / "other.py").write_text("c = 4\n")  # not a builder source
        assert digest() == first
        (package / "nvfp4" / "format.py").write_text("b = 3\n")
        second = digest()
        assert second != first
        (package / "tiny" / "new.py").write_text("")  # a new builder module
        assert digest() != second
    finally:
        build.builder_source_hash.cache_clear()


def test_rebuild_when_incomplete_or_forced(quick_builds, tmp_path, monkeypatch):
    source = quick_builds[0].root
    root = tmp_path / "fam"
    shutil.copytree(source, root)
    real_build = build._build_into
    calls = []

    def copying_build(into, seed, spec, progress):  # the real build is covered by quick_builds
        calls.append(seed)
        for path in source.rglob("*"):
            if path.is_file() and path.name != build.MANIFEST:
                dest = into / path.relative_to(source)
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, dest)
        fields = json.loads((source / build.MANIFEST).read_text())
        fields.pop("files")
        return fields

    monkeypatch.setattr(build, "_build_into", copying_build)
    assert real_build is not copying_build
    weights = root / "dspark" / "model.safetensors"
    original = weights.read_bytes()
    weights.unlink()
    assert not build.is_complete(root, 0, QUICK)
    build_tiny_family(root, seed=0, spec=QUICK, progress=False)
    assert calls == [0] and weights.read_bytes() == original

    weights.write_bytes(original[:-1])  # truncated file: size differs from the manifest
    assert not build.is_complete(root, 0, QUICK)

    marker = root / "target" / "notes.txt"  # a file the manifest does not list: never deleted
    marker.write_text("x")
    with pytest.raises(OutputError, match="holds target/notes.txt, which this command did not"):
        build_tiny_family(root, seed=0, spec=QUICK, force=True, progress=False)
    assert marker.read_text() == "x" and calls == [0]
    marker.unlink()
    build_tiny_family(root, seed=0, spec=QUICK, force=True, progress=False)
    assert calls == [0, 0]
    assert weights.read_bytes() == original
    assert not list(tmp_path.glob(".fam.*")) or all(
        p.suffix == ".lock" for p in tmp_path.glob(".fam.*")
    )


def test_refuses_to_replace_a_foreign_directory(tmp_path):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(OutputError, match="is not empty and was not written by this command"):
        build_tiny_family(foreign, seed=0, spec=QUICK, progress=False)
    with pytest.raises(OutputError, match="not written by this command .*, even with --force"):
        build_tiny_family(foreign, seed=0, spec=QUICK, force=True, progress=False)
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_cache_dir_and_ensure(monkeypatch, tmp_path):
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path / "cache"))
    assert build.default_cache_dir() == tmp_path / "cache"
    monkeypatch.delenv(build.CACHE_ENV)
    assert build.default_cache_dir() == Path.home() / ".cache" / "vllm-nemotron-spec"

    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path / "cache"))
    calls = []
    monkeypatch.setattr(
        build, "build_tiny_family", lambda outdir, seed: calls.append((outdir, seed))
    )
    build.ensure_tiny_family(seed=3)
    assert calls == [(tmp_path / "cache" / "tiny-family-seed3", 3)]


def test_session_family_is_complete(tiny_family, tiny_seed):
    assert build.is_complete(tiny_family.root, tiny_seed)
    m = tiny_family.manifest()
    assert m["seed"] == tiny_seed and m["params_hash"] == TinySpec().params_hash()
    assert tiny_family.root.name == f"tiny-family-seed{tiny_seed}"


@pytest.mark.slow
def test_full_family_rebuild_is_byte_identical(tiny_family, tmp_path):
    """A fresh build of the default seed-0 family equals the cached one byte for byte (minutes)."""
    fresh = build_tiny_family(tmp_path / "fresh", seed=0, progress=False)
    assert (
        json.loads((fresh.root / "manifest.json").read_text())["files"]
        == tiny_family.manifest()["files"]
    )
