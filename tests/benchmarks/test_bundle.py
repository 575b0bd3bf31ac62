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
    done = bundle.pack_caches(packed, home=home, max_parts=10)
    assert done["packed"] and done["dirs"] == [".humming", ".triton"] and len(done["parts"]) >= 2
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


def test_caches_that_need_too_many_parts_are_not_packed(tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / ".triton").mkdir(parents=True)
    (home / ".triton" / "x").write_bytes(os.urandom(5000))
    monkeypatch.setattr(bundle, "PART_BYTES", 1000)
    done = bundle.pack_caches(tmp_path / "p", home=home, max_parts=2)
    assert not done["packed"] and "more than 2" in done["reason"]
    assert not (tmp_path / "p").exists()
    assert bundle.pack_caches(tmp_path / "q", home=tmp_path / "empty")["packed"] is False


def test_a_corrupt_part_is_not_unpacked(tmp_path, monkeypatch):
    home, packed = tmp_path / "home", tmp_path / "packed"
    (home / ".triton").mkdir(parents=True)
    (home / ".triton" / "x").write_bytes(os.urandom(3000))
    monkeypatch.setattr(bundle, "PART_BYTES", 1500)
    bundle.pack_caches(packed, home=home, max_parts=10)
    manifest = json.loads((packed / bundle.MANIFEST).read_text())
    (packed / manifest["parts"][0]["name"]).write_bytes(b"broken")
    assert "waiting for parts" in bundle.restore_caches(packed, tmp_path / "h2", tmp_path / "st")
