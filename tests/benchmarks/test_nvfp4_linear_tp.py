"""benchmarks/nvfp4_linear.py --tp on CPU: each rank's shard of the real draft shapes, loaded by
vLLM's weight loaders under a faked tensor-parallel rank, computes exactly x @ W[its part]^T (the
same script runs vLLM's GPU kernels on one H200); a wrong part is reported as a failure."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "nvfp4_linear.py"
_spec = importlib.util.spec_from_file_location("nvfp4_linear", _PATH)
nl = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("nvfp4_linear", nl)
_spec.loader.exec_module(nl)


@pytest.fixture
def clean_dist():
    """The script sets up vLLM's distributed state when none exists; undo that afterwards."""
    from vllm.distributed import parallel_state as ps

    existed = ps.model_parallel_is_initialized()
    yield
    if not existed and ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()


ARGS = ["--device", "cpu", "--tp", "2", "--m", "2", "--cases", "fc,gate_up_3x,down,markov_w2"]


def test_every_rank_holds_its_part(tmp_path, clean_dist):
    assert nl.main([*ARGS, "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "result.json").read_text())
    ranks = {(r["case"], r["rank"]) for r in result["rows"]}
    # fc is replicated (not split); the others: 2 ranks each, and the row-parallel sum
    assert ranks == {(c, r) for c in ("gate_up_3x", "down", "markov_w2") for r in (0, 1)} | {
        ("down", "sum")
    }
    parts = {(r["case"], r["rank"]): (r.get("rows"), r.get("cols")) for r in result["rows"]}
    assert parts[("gate_up_3x", 1)] == (6144, 2688)  # half of each fused shard's rows
    assert parts[("down", 1)] == (2688, 3072)  # half the input columns: 192 whole 16-blocks
    assert parts[("markov_w2", 0)] == (65536, 512)  # half the vocabulary


def test_a_wrong_part_fails(tmp_path, clean_dist, monkeypatch):
    right = nl.rank_part

    def other_ranks_part(case, reference_w, rank, tp, layer):
        return right(case, reference_w, (rank + 1) % tp, tp, layer)

    monkeypatch.setattr(nl, "rank_part", other_ranks_part)
    args = [*ARGS[:-1], "gate_up_3x", "--out", str(tmp_path)]
    assert nl.main(args) == 1
    failures = json.loads((tmp_path / "result.json").read_text())["failures"]
    assert len(failures) == 2 and all("CPU output differs" in f for f in failures), failures
