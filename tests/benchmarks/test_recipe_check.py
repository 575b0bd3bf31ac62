"""benchmarks/gpu_recipe_check.py: its comparison logic on made-up runs, and the whole script on
CPU at tiny scale (real ``vllm serve`` processes: plain and the trained DSpark draft, greedy,
multi-turn), so that the device run depends on code that has run."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_recipe_check.py"
_spec = importlib.util.spec_from_file_location("gpu_recipe_check", _PATH)
rc = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("gpu_recipe_check", rc)  # dataclasses look their module up there
_spec.loader.exec_module(rc)


def _turn(outputs, hits=0, queries=100, gaps=None):
    return {
        "outputs": outputs,
        "prefix_cache_hits": hits,
        "prefix_cache_queries": queries,
        "top2_gaps": gaps,
    }


def test_compare_finds_the_first_mismatch_and_its_gap():
    plain = {
        "turns": [
            _turn([[1, 2, 3], [4, 5, 6]], gaps=[[0.5, 0.5, 0.5], [0.5, 0.01, 0.5]]),
            _turn([[7, 8], [9, 10]], hits=64),
        ]
    }
    same = {"turns": [_turn([[1, 2, 3], [4, 5, 6]]), _turn([[7, 8], [9, 10]], hits=64)]}
    c = rc.compare(same, plain)
    assert (
        c["exact"]
        and c["prefix_hits_equal"]
        and c["num_outputs"] == 4
        and c["prefix_hits_equal_per_turn"] == [True, True]
    )
    wrong = {"turns": [_turn([[1, 2, 3], [4, 99, 6]]), _turn([[7, 8], [9, 10]], hits=0)]}
    c = rc.compare(wrong, plain)
    assert not c["exact"] and c["num_mismatching_outputs"] == 1
    first = c["mismatches"][0]
    assert (first["turn"], first["conversation"], first["position"]) == (1, 1, 1)
    assert first["reference_top2_logprob_gap"] == 0.01 and first["got"] == [99, 6]
    assert c["prefix_hits_equal_per_turn"] == [True, False] and not c["prefix_hits_equal"]
    short = {"turns": [_turn([[1, 2, 3], [4, 5, 6]])]}  # a run that stopped after one turn
    assert not rc.compare(short, plain)["exact"]


def test_verdict_judges_plugin_rows_only():
    ok = {
        "exact": True,
        "prefix_hits_equal": True,
        "num_mismatching_outputs": 0,
        "num_outputs": 16,
    }
    rows = [
        {"name": "plain@prefix", "variant": "plain", "plugin": True, "status": "ok"},
        {
            "name": "dspark@prefix",
            "variant": "dspark",
            "plugin": True,
            "status": "ok",
            "comparison": ok,
        },
        {
            "name": "dspark-upstream@prefix",
            "variant": "dspark-upstream",
            "plugin": False,
            "status": "ok",
            "comparison": dict(ok, prefix_hits_equal=False),
        },
    ]
    text, passed = rc.verdict({"configs": rows})
    assert passed and text.startswith("RECIPE CHECK: PASS - 1/1") and "upstream" in text
    rows[0].update(flags="prefix", cache_config={"enable_prefix_caching": "False"})
    text, passed = rc.verdict({"configs": rows})
    assert passed and "prefix caching asked for but OFF in the engine for plain@prefix" in text
    rows[1]["comparison"] = dict(ok, exact=False, num_mismatching_outputs=2)
    text, passed = rc.verdict({"configs": rows})
    assert not passed and "dspark@prefix NOT EXACT" in text
    rows[1] = {
        "name": "dspark@fp8",
        "variant": "dspark",
        "plugin": True,
        "status": "error",
        "error": "boom",
    }
    assert not rc.verdict({"configs": rows})[1]


def test_verdict_accepts_a_draft_that_parts_from_plain_exactly_as_vllm_alone_does():
    """On the H200 in bf16 both vLLM alone and the plugin part from plain decoding at a near-tie;
    a plugin row passes then only by equalling vLLM alone's outputs and hits token for token."""
    ok = {"exact": True, "prefix_hits_equal": True, "num_mismatching_outputs": 0, "num_outputs": 16}
    parted = dict(
        ok,
        exact=False,
        prefix_hits_equal=False,
        num_mismatching_outputs=2,
        mismatches=[
            {"turn": 1, "conversation": 3, "position": 34, "reference_top2_logprob_gap": 0.0}
        ],
    )

    def rows(twin):
        plugin_row = {
            "name": "dspark@recipe",
            "variant": "dspark",
            "plugin": True,
            "status": "ok",
            "comparison": parted,
        }
        if twin is not None:
            plugin_row["vs_vllm_alone"] = twin
        upstream = {
            "name": "dspark-upstream@recipe",
            "variant": "dspark-upstream",
            "plugin": False,
            "status": "ok",
            "comparison": parted,
        }
        return {"configs": [plugin_row, upstream]}

    text, passed = rc.verdict(rows(ok))
    assert passed, text
    assert "0/1 plugin configurations exact" in text and "1 token for token as vLLM alone" in text
    assert (
        "2 outputs differ from plain, first at top-2 gap 0.0, prefix hits differ from plain" in text
    )
    hits_only = dict(parted, exact=True, num_mismatching_outputs=0, mismatches=[])
    text, passed = rc.verdict({"configs": [dict(rows(ok)["configs"][0], comparison=hits_only)]})
    assert passed and "dspark@recipe (prefix hits differ from plain)" in text, text
    assert rc._as_vllm_alone(ok) == "16/16, equal"
    one_off = dict(ok, exact=False, num_mismatching_outputs=1)
    text, passed = rc.verdict(rows(one_off))
    assert not passed and "dspark@recipe (1 outputs differ from vLLM alone)" in text, text
    assert rc._as_vllm_alone(one_off) == "15/16, equal"
    text, passed = rc.verdict(rows(dict(ok, prefix_hits_equal=False)))
    assert not passed and "dspark@recipe (prefix hits differ from vLLM alone)" in text, text
    text, passed = rc.verdict(rows(None))  # no vLLM alone beside it: plain is the only bar
    assert (
        not passed
        and "dspark@recipe NOT EXACT (2 outputs differ from plain, first at top-2 gap 0.0, " in text
    )


def test_workload_segments(tiny_family):
    w = rc.make_workload(tiny_family.tokenizer, 3, 4, 50, 20, 8)
    assert w.turns == 4 and len(w.segments) == 3
    assert all(len(c[0]) == 50 and all(len(s) == 20 for s in c[1:]) for c in w.segments)
    firsts = [tuple(c[0]) for c in w.segments]
    assert len(set(firsts)) == 3  # distinct conversations


def test_flashinfer_shaped_family_differs_only_in_head_sizes():
    """FlashInfer 0.7.2 has no kernel for the default family's heads (attention 32, Mamba 16 with
    a 16-wide state): its twin takes the real model's head sizes and keeps the rest."""
    import dataclasses

    from vllm_nemotron_spec.tiny.build import TinySpec

    fi, default = rc.flashinfer_shaped_spec(), TinySpec()
    assert (fi.target.head_dim, fi.target.mamba_head_dim, fi.target.ssm_state_size) == (
        128,
        64,
        128,
    )
    assert fi.draft.head_dim == 128
    assert (
        dataclasses.replace(
            fi,
            target=dataclasses.replace(
                fi.target, head_dim=32, mamba_head_dim=16, ssm_state_size=16
            ),
            draft=dataclasses.replace(fi.draft, head_dim=32),
        )
        == default
    )
    assert fi.params_hash() != default.params_hash()  # cached apart


def test_parse_configs():
    cfgs = rc.parse_configs("plain@prefix, dspark-upstream@fp8")
    assert [(c.name, c.method, c.plugin) for c in cfgs] == [
        ("plain@prefix", None, True),
        ("dspark-upstream@fp8", "dspark", False),
    ]
    with pytest.raises(SystemExit):
        rc.parse_configs("dspark@nope")


@pytest.mark.engine
def test_recipe_check_runs_on_cpu(tiny_family, tmp_path):
    """plain and DSpark servers with prefix caching (Mamba align mode, the KV cache in the model
    dtype; the fp8 cache is served in tests/e2e/test_recipe_serving.py), 2 conversations x 2
    turns: the second turn's prompt is the first turn's prompt + answer + user text and reuses its
    first block, every output and every turn's prefix hits equal to plain's, the trained draft
    accepting what a wrong layout could not (offline it reaches 3.3 at 3 drafts; a wrong anchor
    1.08)."""
    out = tmp_path / "rc"
    cache = Path(tiny_family.root).parent
    code = rc.main(
        [
            "--out",
            str(out),
            "--device",
            "cpu",
            "--family",
            str(cache),
            "--configs",
            "plain@prefix,dspark@prefix",
            "--conversations",
            "2",
            "--turns",
            "2",
            "--first-tokens",
            "150",
            "--user-tokens",
            "60",
            "--max-tokens",
            "12",
            "--max-model-len",
            "512",
            "--start-timeout",
            "300",
        ]
    )
    result = json.loads((out / "recipe_check.json").read_text())
    rows = {r["name"]: r for r in result["configs"]}
    assert code == 0, result["verdict"]
    assert rows["plain@prefix"]["status"] == "ok" and rows["dspark@prefix"]["status"] == "ok"
    comparison = rows["dspark@prefix"]["comparison"]
    assert comparison["exact"] and comparison["prefix_hits_equal"]
    assert rows["dspark@prefix"]["cache_config"]["enable_prefix_caching"] == "True"
    turns = rows["dspark@prefix"]["turns"]
    assert turns[0]["prefix_cache_hits"] == 0 and turns[1]["prefix_cache_hits"] > 0
    assert [t["prompt_lengths"] for t in turns] == [[150, 150], [150 + 12 + 60] * 2]
    assert [t["prompt_tokens"] for t in turns] == [
        300,
        2 * (150 + 12 + 60),
    ]  # the server counted them
    assert all(len(o) == 12 for t in turns for o in t["outputs"])
    drafts = sum(t["num_drafts"] for t in turns)
    accepted = sum(t["num_accepted_tokens"] for t in turns)
    assert drafts > 0 and 1 + accepted / drafts > 1.5
    assert result["verdict"].startswith("RECIPE CHECK: PASS")
    assert (out / "recipe_check.md").read_text().count("| dspark@prefix | ok |") == 1


METRICS = """# HELP vllm:prefix_cache_queries Prefix cache queries
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1200.0
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 768.0
vllm:num_preemptions_total{engine="0",model_name="m"} 2.0
vllm:cache_config_info{block_size="128",cache_dtype="fp8",enable_prefix_caching="True",engine="0",mamba_cache_mode="align"} 1.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 0.5
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 1.0
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 15.0
"""


def test_metrics_snapshot_and_delta():
    common = sys.modules["_common"]  # imported by gpu_recipe_check
    after = common.parse_snapshot(METRICS)
    assert (after.prefix_queries, after.prefix_hits, after.preemptions) == (1200, 768, 2)
    assert after.cache_config == {
        "block_size": "128",
        "cache_dtype": "fp8",
        "enable_prefix_caching": "True",
        "mamba_cache_mode": "align",
    }
    before = common.parse_snapshot(
        METRICS.replace("1200.0", "200.0")
        .replace("768.0", "268.0")
        .replace('_sum{engine="0",model_name="m"} 0.5', '_sum{engine="0",model_name="m"} 0.1')
        .replace('_count{engine="0",model_name="m"} 4.0', '_count{engine="0",model_name="m"} 2.0')
        .replace(
            'num_drafts_total{engine="0",model_name="m"} 10.0',
            'num_drafts_total{engine="0",model_name="m"} 4.0',
        )
    )
    d = after.minus(before).to_json()
    assert (
        d["prefix_cache_queries"] == 1000
        and d["prefix_cache_hits"] == 500
        and d["prefix_hit_rate"] == 0.5
    )
    assert d["server_ttft_ms"] == 200.0  # (0.5 - 0.1) s over 2 requests
    assert (
        d["num_drafts"] == 6 and d["mean_acceptance_length"] == 1 + 0 / 6
    )  # accepted unchanged: 15 - 15
