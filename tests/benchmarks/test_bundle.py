"""benchmarks/harness/bundle.py: results and start-up caches through the GPU machine's $OUT (at
most 8 files of 16 MiB), caches restored once all their parts have arrived."""

from __future__ import annotations

import json
import os
import shutil
import tarfile

import pytest

from benchmarks.harness import bundle


def test_parts_stay_under_the_limit_and_join_back(tmp_path):
    data = os.urandom(2500)
    parts = bundle.split_into_parts(data, tmp_path, "x.tgz", part_bytes=1000)
    assert [p.name for p in parts] == ["x.tgz.part-00", "x.tgz.part-01", "x.tgz.part-02"]
    assert all(p.stat().st_size <= 1000 for p in parts)
    assert b"".join(p.read_bytes() for p in parts) == data
    assert [p.name for p in bundle.split_into_parts(b"ab", tmp_path / "one", "y")] == ["y"]


def test_results_bundle_holds_the_report_and_out_without_traces(tmp_path):
    out = tmp_path / "speed-out"
    (out / "logs").mkdir(parents=True)
    (out / "speed.md").write_text("# report\n")
    (out / "speed.json").write_text("{}\n")
    (out / "logs" / "lane-alone.log").write_text("log\n")
    (out / "traces").mkdir()
    (out / "traces" / "big.pt.trace.json").write_text("x" * 1000)
    dest = tmp_path / "OUT"
    files = bundle.bundle_results(out, dest, "speed")
    assert sorted(p.name for p in files) == ["speed-out.tgz", "speed.json", "speed.md"]
    with tarfile.open(dest / "speed-out.tgz") as tar:
        names = tar.getnames()
    assert "speed-out/logs/lane-alone.log" in names and not any("traces" in n for n in names)


def test_results_bundle_refuses_more_files_than_come_back(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "s.md").write_text("r")
    dest = tmp_path / "OUT"
    dest.mkdir()
    for i in range(7):
        (dest / f"other{i}").write_text("x")
    with pytest.raises(RuntimeError, match="at most 8 come back"):
        bundle.bundle_results(out, dest, "s")


def test_caches_pack_and_restore_once_every_part_is_there(tmp_path, monkeypatch):
    home, packed = tmp_path / "home", tmp_path / "packed"
    (home / ".humming" / "kernels").mkdir(parents=True)
    (home / ".humming" / "kernels" / "k.so").write_bytes(os.urandom(3000))
    (home / ".triton" / "cache").mkdir(parents=True)
    (home / ".triton" / "cache" / "t.json").write_text("{}")
    monkeypatch.setattr(bundle, "PART_BYTES", 1200)
    done = bundle.pack_caches(packed, home=home, max_parts=7, staging=tmp_path / "pack")
    assert done["packed"] and done["dirs"] == [".humming", ".triton"] and len(done["parts"]) >= 2
    assert done["next_part"] is None and len(done["copied"]) == len(done["parts"])
    fresh, staging = tmp_path / "fresh-home", tmp_path / "staging"
    first = tmp_path / "command-1"  # the parts arrive over two commands
    first.mkdir()
    shutil.copy2(packed / bundle.MANIFEST, first)
    shutil.copy2(packed / done["parts"][0]["name"], first)
    assert "waiting for parts" in bundle.restore_caches(first, fresh, staging)
    assert not (fresh / ".humming").exists()
    assert bundle.restore_caches(packed, fresh, staging).startswith("start-up caches restored")
    assert (fresh / ".humming" / "kernels" / "k.so").read_bytes() == (
        home / ".humming" / "kernels" / "k.so"
    ).read_bytes()
    assert bundle.restore_caches(packed, fresh, staging) == "start-up caches already restored"


def test_a_pack_larger_than_a_command_comes_back_over_several(tmp_path, monkeypatch):
    """At most 8 files come back from a command: the pack stays on the machine and each command
    brings the next parts and the manifest; the parts restore once all have arrived."""
    home, pack = tmp_path / "home", tmp_path / "pack"
    (home / ".triton").mkdir(parents=True)
    (home / ".triton" / "x").write_bytes(os.urandom(5000))
    monkeypatch.setattr(bundle, "PART_BYTES", 1000)
    first = bundle.pack_caches(tmp_path / "c1", home=home, max_parts=2, staging=pack)
    assert first["copied"] == ["caches.tgz.part-00", "caches.tgz.part-01"]
    n = len(first["parts"])  # 5,000 random bytes and the tar's headers: 6 parts or so
    assert first["next_part"] == 2 and 3 <= n <= 9
    assert sorted(p.name for p in (tmp_path / "c1").iterdir()) == ["caches.json", *first["copied"]]
    (home / ".triton" / "x").write_bytes(b"changed later")  # the next commands keep the pack
    second = bundle.pack_caches(tmp_path / "c2", home=home, max_parts=7, from_part=2, staging=pack)
    assert second["copied"] == [f"caches.tgz.part-0{i}" for i in range(2, n)]
    assert second["next_part"] is None and second["parts"] == first["parts"]
    fresh, staging = tmp_path / "fresh", tmp_path / "staging"
    assert "waiting for parts" in bundle.restore_caches(tmp_path / "c1", fresh, staging)
    assert bundle.restore_caches(tmp_path / "c2", fresh, staging).startswith("start-up caches")
    assert len((fresh / ".triton" / "x").read_bytes()) == 5000


def test_a_pack_that_cannot_be_made_or_continued_says_why(tmp_path, monkeypatch):
    assert bundle.pack_caches(tmp_path / "q", home=tmp_path / "empty",
                              staging=tmp_path / "s")["packed"] is False  # fmt: skip
    done = bundle.pack_caches(tmp_path / "q", from_part=3, staging=tmp_path / "none")
    assert not done["packed"] and "no pack" in done["reason"]
    home = tmp_path / "home"
    (home / ".triton").mkdir(parents=True)
    (home / ".triton" / "x").write_bytes(b"x")
    bundle.pack_caches(tmp_path / "q", home=home, staging=tmp_path / "s")
    done = bundle.pack_caches(tmp_path / "q", from_part=1, staging=tmp_path / "s")
    assert not done["packed"] and "parts 0-0" in done["reason"]
    with pytest.raises(ValueError, match="1 to 7 parts a command"):
        bundle.pack_caches(tmp_path / "q", home=home, max_parts=8, staging=tmp_path / "s")


def test_a_corrupt_part_is_not_unpacked(tmp_path, monkeypatch):
    home, packed = tmp_path / "home", tmp_path / "packed"
    (home / ".triton").mkdir(parents=True)
    (home / ".triton" / "x").write_bytes(os.urandom(3000))
    monkeypatch.setattr(bundle, "PART_BYTES", 1500)
    bundle.pack_caches(packed, home=home, max_parts=7, staging=tmp_path / "pack")
    manifest = json.loads((packed / bundle.MANIFEST).read_text())
    (packed / manifest["parts"][0]["name"]).write_bytes(b"broken")
    assert "waiting for parts" in bundle.restore_caches(packed, tmp_path / "h2", tmp_path / "st")


def test_the_caches_command_says_which_parts_came_and_where_the_next_command_starts(
    tmp_path, monkeypatch, capsys
):
    from benchmarks.harness import cli

    (tmp_path / ".triton").mkdir()
    (tmp_path / ".triton" / "x").write_bytes(os.urandom(5000))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(bundle, "PART_BYTES", 1000)
    monkeypatch.setattr(bundle, "PACK_STAGING", tmp_path / "pack")
    assert cli.main(["caches", "pack", str(tmp_path / "out"), "--max-parts", "2"]) == 0
    said = capsys.readouterr().out
    assert "parts 0-1 in" in said and "next command: caches pack FOLDER --from-part 2" in said
    assert cli.main(["caches", "pack", str(tmp_path / "o2"), "--max-parts", "7",
                     "--from-part", "2"]) == 0  # fmt: skip
    assert "that is every part" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--max-parts 8: 1 to 7"):
        cli.main(["caches", "pack", str(tmp_path / "o3"), "--max-parts", "8"])
