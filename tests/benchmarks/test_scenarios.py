"""Every scenario but speed (tests/benchmarks/test_speed.py) runs its CPU path here: the tiny
family and tiny grids, every code path without a GPU, checked for what each must produce. The
``benchmarks/run.py`` runs start in the background (conftest.py) while the in-process ones run."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks.harness import cli
from benchmarks.harness import nvfp4_layers as nl


@pytest.fixture
def clean_dist():
    """nvfp4-linear sets up vLLM's distributed state when none exists; undo that afterwards."""
    from vllm.distributed import parallel_state as ps

    existed = ps.model_parallel_is_initialized()
    yield
    if not existed and ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()


TP_ARGS = ["--smoke", "--tp", "2", "--m", "2", "--cases", "fc,gate_up_3x,down,markov_w2"]


def test_nvfp4_linear_tp_every_rank_holds_its_part(tmp_path, clean_dist):
    assert cli.main(["nvfp4-linear", *TP_ARGS, "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "nvfp4-linear.json").read_text())
    ranks = {(r["case"], r["rank"]) for r in result["rows"]}
    # fc is replicated (not split); the others: 2 ranks each, and the row-parallel sum
    assert ranks == {(c, r) for c in ("gate_up_3x", "down", "markov_w2") for r in (0, 1)} | {
        ("down", "sum")
    }
    parts = {(r["case"], r["rank"]): (r.get("rows"), r.get("cols")) for r in result["rows"]}
    assert parts[("gate_up_3x", 1)] == (6144, 2688)  # half of each fused shard's rows
    assert parts[("down", 1)] == (2688, 3072)  # half the input columns: 192 whole 16-blocks
    assert parts[("markov_w2", 0)] == (65536, 512)  # half the vocabulary
    assert "**PASS**" in (tmp_path / "nvfp4-linear.md").read_text()


def test_nvfp4_linear_tp_a_wrong_part_fails(tmp_path, clean_dist, monkeypatch):
    right = nl.rank_part

    def other_ranks_part(case, reference_w, rank, tp, layer):
        return right(case, reference_w, (rank + 1) % tp, tp, layer)

    monkeypatch.setattr(nl, "rank_part", other_ranks_part)
    args = [*TP_ARGS[:-1], "gate_up_3x", "--out", str(tmp_path)]
    assert cli.main(["nvfp4-linear", *args]) == 1
    failures = json.loads((tmp_path / "nvfp4-linear.json").read_text())["failures"]
    assert len(failures) == 2 and all("CPU output differs" in f for f in failures), failures


def test_nvfp4_linear_cpu_outputs_are_exact(tmp_path, clean_dist):
    assert cli.main(["nvfp4-linear", "--smoke", "--m", "1", "--cases", "down", "--reps", "1",
                     "--out", str(tmp_path)]) == 0  # fmt: skip
    rows = json.loads((tmp_path / "nvfp4-linear.json").read_text())["rows"]
    assert [(r["dtype"], r["exact"]) for r in rows] == [("float32", True), ("bfloat16", True)]


def test_gpu_tolerance_arithmetic():
    assert nl.gpu_tolerance("MarlinNvFp4LinearKernel", 1e-3) == 2e-3 + 2**-9
    assert nl.gpu_tolerance("MarlinNvFp4LinearKernel", 1.0) == 2**-6  # never above
    assert nl.gpu_tolerance("HummingNvFp4LinearKernel", 1e-6) == 2**-6  # BF16 split-K sums


@pytest.mark.engine
def test_tp_scenario_is_lossless_on_cpu(tmp_path):
    assert cli.main(["tp", "--smoke", "--out", str(tmp_path)]) == 0
    runs = json.loads((tmp_path / "tp.json").read_text())["runs"]
    assert [(r["tp"], r["method"]) for r in runs] == [(1, "plain"), (1, "dspark")]
    assert runs[1]["lossless"] and runs[1]["markov_walk"]


def test_tp_methods_option():
    from benchmarks.scenarios import tp

    assert tp.methods("dspark, dflash,dspark") == ["dspark", "dflash"]
    for bad in ("", "eagle", "dspark,mtp"):
        with pytest.raises(argparse.ArgumentTypeError, match="subset of dflash, dspark"):
            tp.methods(bad)


@pytest.mark.engine
def test_draft_breakdown_attributes_the_draft_step_on_cpu(draft_breakdown_run):
    out, done = draft_breakdown_run.result()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (window,) = json.loads((out / "draft-breakdown.json").read_text())["arms"]["dspark3-plugin"][
        "windows"
    ]
    b = window["breakdown"]
    parts = {r["part"] for r in b["rows"] if r["gpu_ms_per_step"]}
    assert {"context_kv", "layer0.attn", "layer0.mlp", "lm_head", "markov_walk"} <= parts
    assert b["steps_profiled"] == window["steps"] == 3
    assert any(line.startswith("module model.layers.5.mlp") for line in window["ranges"])


@pytest.mark.engine
def test_served_scenarios_on_cpu(serving_run, anchor_run):
    """serving (multi-turn, a shared prefix) and anchor (sessions with their own cached
    context) each through one real plugin server on 127.0.0.1."""
    out, done = serving_run.result()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (c,) = json.loads((out / "serving.json").read_text())["servers"]["dspark3-plugin"][
        "concurrency"
    ]
    assert c["repeats"] == 2 and all(r["requests"] == 2 * 2 for r in c["repeats_detail"])
    assert c["output_tokens"] == 2 * 2 * 2 * 6 and c["mean_acceptance_length"] >= 1.0
    out, done = anchor_run.result()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    entry = json.loads((out / "anchor.json").read_text())["servers"]["dflash5-plugin"]
    (c,) = entry["concurrency"]
    assert c["mean_prompt_tokens"] == pytest.approx(200 + (20 + 8) / 2)  # turn 2 adds a turn
    # vLLM's per-request split, read from the server's /metrics under these names
    assert c["server_prefill_ms"] > 0 and c["server_decode_ms"] > 0
    assert c["server_queue_ms"] is not None
    # the profiled repeat: vLLM's profiler started over HTTP, recording 2 engine steps after 1
    prof = c["profile"]
    assert prof["status"] == "ok" and (prof["skip_steps"], prof["steps"]) == (1, 2), prof
    assert prof["counted"] == "CPU ops (no GPU)" and prof["busy_ms"] > 0
    assert sum(prof["families_ms"].values()) > 0 and prof["top_kernels"]
    assert (out / "traces" / prof["trace"]).is_file()
    text = (out / "anchor.md").read_text()
    assert "1744 (16, 3.18)" in text and "Where a profiled turn's GPU time went" in text


def test_mamba_metadata_checks_sharing_against_every_groups_own_build(tmp_path, monkeypatch):
    args = ["mamba-metadata", "--smoke", "--groups", "3", "--calls", "2", "--out", str(tmp_path)]
    assert cli.main(args) == 0
    result = json.loads((tmp_path / "mamba-metadata.json").read_text())
    assert [(r["mode"], r["requests"], r["equal"]) for r in result["rows"]] == [
        ("none", 1, True),
        ("align", 1, True),
    ]
    assert all(r["us_own"] > 0 and r["us_shared"] > 0 for r in result["rows"])
    # a sharing that kept the first group's state indices is caught and fails the run
    from vllm.v1.attention.backends.mamba2_attn import Mamba2AttentionMetadataBuilder

    monkeypatch.setattr(Mamba2AttentionMetadataBuilder, "update_block_table", lambda s, m, b, _: m)
    assert cli.main([*args, "--out", str(tmp_path / "wrong")]) == 1
    failures = json.loads((tmp_path / "wrong" / "mamba-metadata.json").read_text())["failures"]
    assert failures and all("state_indices_tensor" in f for f in failures), failures
    with pytest.raises(SystemExit, match="--groups 1"):
        cli.main(["mamba-metadata", "--smoke", "--groups", "1", "--out", str(tmp_path)])
