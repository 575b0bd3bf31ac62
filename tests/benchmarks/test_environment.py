"""benchmarks/harness/environment.py: the commit a report records."""

from __future__ import annotations

import subprocess

from benchmarks.harness import environment


def test_the_commit_is_benchs_commit_when_set(monkeypatch):
    monkeypatch.setenv("BENCH_COMMIT", "abc1234")
    assert environment.git_commit() == "abc1234"
    assert environment.setup_facts(["speed"])["commit"] == "abc1234"


def test_the_commit_is_the_checkouts_head_otherwise(monkeypatch):
    monkeypatch.delenv("BENCH_COMMIT", raising=False)
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=environment.REPO, capture_output=True,
        text=True, check=False,
    ).stdout.strip()  # fmt: skip
    commit = environment.git_commit()
    if head:
        assert commit.removesuffix("+dirty") == head
    else:  # a copy of the tree without git metadata
        assert commit is None
