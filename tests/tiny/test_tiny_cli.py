"""``vllm-nemotron-spec make-tiny``."""

from __future__ import annotations

import pytest

from vllm_nemotron_spec.cli import main as cli
from vllm_nemotron_spec.tiny import build


def test_help(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["make-tiny", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for text in ("OUTDIR", "--seed", "--force", "DFlash", "DSpark", "byte-identical"):
        assert text in out


def test_listed_in_top_level_help(capsys):
    cli.build_parser().print_help()
    assert "make-tiny" in capsys.readouterr().out


def test_reuses_existing_family_and_prints_paths(tiny_family, tiny_seed, capsys, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("make-tiny rebuilt the complete session family")

    monkeypatch.setattr(build, "_build_into", fail)
    args = ["make-tiny", str(tiny_family.root), "--seed", str(tiny_seed), "--quiet"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    for path in (
        tiny_family.root,
        tiny_family.target,
        tiny_family.dflash_draft,
        tiny_family.dspark_draft,
    ):
        assert str(path) in out


def test_passes_seed_and_force(monkeypatch, tmp_path, capsys):
    from vllm_nemotron_spec.tiny import build

    calls = []

    def fake_build(outdir, seed=0, force=False, progress=True):
        calls.append((str(outdir), seed, force, progress))
        return build.TinyFamily.at(outdir)

    monkeypatch.setattr(build, "build_tiny_family", fake_build)
    assert cli.main(["make-tiny", str(tmp_path / "x"), "--seed", "7", "--force"]) == 0
    assert calls == [(str(tmp_path / "x"), 7, True, True)]
    assert str(tmp_path / "x" / "dspark") in capsys.readouterr().out
