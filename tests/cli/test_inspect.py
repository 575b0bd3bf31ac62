"""``vllm-nemotron-spec inspect``: through the CLI's main(), output and exit code."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import draft_configs as dc
from vllm_nemotron_spec.cli.main import main


def inspect(capsys, *argv) -> tuple[int, str, str]:
    try:
        rc = main(["inspect", *map(str, argv)])
    except SystemExit as exc:  # argparse usage errors
        rc = exc.code
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return rc, out, err


def inspect_json(capsys, *argv) -> tuple[int, dict]:
    rc, out, err = inspect(capsys, *argv, "--json")
    assert err == ""
    return rc, json.loads(out)


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """Full-size official drafts (header-only sparse weights) and the NemotronH target config."""
    root = tmp_path_factory.mktemp("full")
    return {
        "dflash": dc.write_draft(str(root / "dflash"), dc.dflash_config(), real=False),
        "dspark": dc.write_draft(str(root / "dspark"), dc.dspark_config(), real=False, shards=3),
        "target": dc.write_target(str(root / "target"), dc.target_config()),
    }


def test_official_dspark_text(capsys, full):
    rc, out, err = inspect(capsys, full["dspark"], "--target", full["target"])
    assert rc == 0 and err == ""
    lines = {line.split("  ")[0]: line for line in out.splitlines() if line and line[0] != " "}
    assert lines["method"].endswith("dspark (Qwen3DSparkModel)")
    assert "Nemotron 3.5: own embed_tokens, the target's lm_head" in lines["layout"]
    assert "sample_from_anchor=false: gamma+1 query rows [b, MASK x gamma]" in lines["anchor"]
    assert "8 drafted tokens (block_size 8, at most 8) -> 9 query rows" in lines["gamma"]
    assert lines["mask token"].endswith("990")
    assert "causal, sliding window 1024, attention sinks; RoPE theta 10000" in lines["attention"]
    assert (
        "[2, 6, 20, 30, 42, 52] (target_layer_ids [1, 5, 19, 29, 41, 51] + 1) vs the "
        "target's 52 blocks: ok" in lines["aux ids"]
    )
    assert "embed_tokens: the draft's own; lm_head: the target's" in lines["embedding"]
    assert lines["serve"].endswith(
        f'vllm serve {full["target"]} --speculative-config \'{{"method": "dspark", "model": '
        f'"{full["dspark"]}", "num_speculative_tokens": 8}}\''
    )
    assert (
        "NVFP4  fc" in out
        and "logical [2688, 16128] stored uint8 [2688, 8064], scales F8_E4M3 [2688, 1008]" in out
    )
    assert "NVFP4  markov_head.markov_w2" in out and "[131072, 256]" in out
    assert "BF16   layers.*.self_attn.q_proj (x6)" in out
    assert "BF16   markov_head.markov_w1.weight" in out


def test_official_dflash_json(capsys, full):
    rc, r = inspect_json(capsys, full["dflash"], "--target", full["target"], "-k", "6")
    assert rc == 0 and r["ok"] and r["problems"] == []
    assert (r["method"], r["nemotron35_layout"], r["sample_from_anchor"]) == ("dflash", True, False)
    assert (r["block_size"], r["num_speculative_tokens"], r["num_query_rows"]) == (None, 6, 7)
    assert r["aux_hidden_state_ids"] == [2, 6, 20, 30, 42, 52] and r["target_blocks"] == 52
    assert (r["embed_tokens"], r["lm_head"]) == ("draft", "target")
    assert r["attention"]["causal"] is False and r["attention"]["sliding_window"] is None
    assert r["speculative_config"] == {
        "method": "dflash",
        "model": full["dflash"],
        "num_speculative_tokens": 6,
    }
    nvfp4 = {m["name"] for m in r["quantization"]["modules"] if m["format"] == "nvfp4"}
    assert nvfp4 == {"fc"} | {
        f"layers.{i}.mlp.{p}_proj" for i in range(6) for p in ("gate", "up", "down")
    }
    assert r["checkpoint"]["num_tensors"] == len(r["checkpoint"]["tensors"]) == 108
    assert r["spec"]["rope_scaling"]["rope_type"] == "yarn"


def test_without_target_the_command_has_a_placeholder(capsys, full):
    rc, out, _ = inspect(capsys, full["dflash"])
    assert rc == 0
    assert "pass --target to check them against the target's blocks" in out
    assert (
        f'vllm serve TARGET --speculative-config \'{{"method": "dflash", "model": '
        f'"{full["dflash"]}", "num_speculative_tokens": 5}}\''
    ) in out


def test_config_json_path(capsys, full):
    rc, r = inspect_json(
        capsys,
        os.path.join(full["dspark"], "config.json"),
        "--target",
        os.path.join(full["target"], "config.json"),
    )
    assert rc == 0
    assert r["speculative_config"]["model"] == full["dspark"]
    assert f"vllm serve {full['target']} --speculative-config" in r["serve_command"]


def test_gamma_beyond_block_size(capsys, full):
    rc, out, err = inspect(capsys, full["dspark"], "-k", "9")
    assert rc == 2
    assert "9 requested (block_size 8, at most 8)" in out
    assert "num_speculative_tokens=9 exceeds the trained block_size 8: acceptance collapses" in err
    assert "serve" not in out.split("\n\n")[0].splitlines()[-1]


def test_target_with_fewer_blocks(capsys, full, tmp_path):
    target = dc.write_target(
        str(tmp_path),
        dict(
            dc.target_config(),
            hybrid_override_pattern="ME" * 25,
            num_hidden_layers=50,
            vocab_size=131000,
        ),
    )
    rc, r = inspect_json(capsys, full["dflash"], "--target", target)
    assert rc == 2 and not r["ok"] and "serve_command" not in r
    assert r["problems"] == [
        "target config: aux hidden state id 52 (target_layer_ids[5] = 51, + 1) is beyond the "
        "target's 50 blocks: aux id k is the residual stream after block k-1, so ids run 1..50 "
        "(50 = after the last block, before the final norm)",
        "target config: `vocab_size`: the draft has 131072 but the target has 131000 (drafted "
        "ids are verified by the target and logits use its lm_head)",
    ]


def test_every_problem_is_listed(capsys, tmp_path):
    import torch

    cfg = dc.mutated(
        dc.dspark_config(dc.SMALL), markov_head_type="mlp", eagle_aux_hidden_state_layer_ids=[1, 5]
    )
    d = dc.write_draft(
        str(tmp_path),
        cfg,
        tensors_hook=lambda t: dict(
            t, **{"layers.0.mlp.up_proj.weight": torch.zeros(96, 64, dtype=torch.bfloat16)}
        ),
    )
    rc, out, err = inspect(capsys, d)
    assert rc == 2
    assert "2 problem(s):" in err
    assert '`markov_head_type`: the Nemotron 3.5 DSpark draft needs "vanilla"' in err
    assert "`eagle_aux_hidden_state_layer_ids` is [1, 5] but must be target_layer_ids + 1" in err
    # Weights are checked once the config is valid.
    rc, out, err = inspect(
        capsys,
        dc.write_draft(
            str(tmp_path / "ok"),
            dc.dspark_config(dc.SMALL),
            tensors_hook=lambda t: dict(
                t, **{"layers.0.mlp.up_proj.weight": torch.zeros(96, 64, dtype=torch.bfloat16)}
            ),
        ),
    )
    assert rc == 2
    assert (
        "draft weights: `layers.0.mlp.up_proj.weight`: found BF16 [96, 64] (unquantized) but "
        "quantization_config (W4A16_NVFP4) does not exclude `layers.0.mlp.up_proj`: expected "
        "NVFP4 uint8 [96, 32] (logical [96, 64])"
    ) in err
    assert "<- problem" in out


def test_generic_draft(capsys, tmp_path):
    d = tmp_path / "zlab"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(dc.zlab_qwen3_dflash_config()))
    rc, r = inspect_json(capsys, d)
    assert rc == 2  # no weights written
    assert r["nemotron35_layout"] is False and r["num_speculative_tokens"] == 15
    assert (
        r["problems"][0].startswith("draft weights: ")
        and "no model.safetensors" in r["problems"][0]
    )


def test_bad_paths(capsys, tmp_path):
    rc, out, err = inspect(capsys, tmp_path / "nope")
    assert rc == 2 and "nope': no such file or directory" in err
    rc, out, err = inspect(capsys, tmp_path, "--target", tmp_path / "nope")
    assert rc == 2 and "draft: " not in err and "no config.json in this directory" in err
    rc, out, err = inspect(capsys, tmp_path, "-k", "x")
    assert rc == 2 and "invalid int value" in err


# ---- fuzz: whatever the files hold, inspect answers 0 or 2 and never a traceback -------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)


def run_fuzz(capsys, draft, *extra):
    for argv in ((draft, *extra), (draft, *extra, "--json")):
        rc, out, err = inspect(capsys, *argv)
        assert rc in (0, 2), (rc, out, err)
        if "--json" in argv:
            report = json.loads(out)
            assert report["ok"] == (rc == 0)
            assert all(isinstance(p, str) for p in report["problems"])
        elif rc == 2:
            assert "problem(s):" in err


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    dc.write_draft(str(root / "pristine"), dc.dspark_config(dc.SMALL), shards=2)
    dc.write_target(str(root / "target"), dc.target_config(dc.SMALL))
    return root


def fresh(fuzz_dir):
    work = fuzz_dir / "work"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(fuzz_dir / "pristine", work)
    return work


@st.composite
def config_edits(draw):
    cfg = draw(st.sampled_from([dc.dspark_config, dc.dflash_config]))(dc.SMALL)
    for _ in range(draw(st.integers(1, 4))):
        nested = draw(st.sampled_from([None, "dflash_config", "quantization_config"]))
        where = cfg[nested] if nested and isinstance(cfg.get(nested), dict) else cfg
        key = draw(st.sampled_from(sorted(where) or ["x"]))
        action = draw(st.sampled_from(["delete", "json", "int", "ids"]))
        if action == "delete":
            where.pop(key, None)
        elif action == "json":
            where[key] = draw(JSON)
        elif action == "int":
            where[key] = draw(st.integers(-3, 600))
        else:
            where[key] = draw(st.lists(st.integers(-1, 6), max_size=3))
    return cfg


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(cfg=config_edits(), gamma=st.one_of(st.none(), st.integers(-1, 9)))
def test_fuzz_corrupted_config(capsys, fuzz_dir, cfg, gamma):
    work = fresh(fuzz_dir)
    (work / "config.json").write_text(json.dumps(cfg))
    extra = ("--target", fuzz_dir / "target") + (("-k", gamma) if gamma is not None else ())
    run_fuzz(capsys, work, *extra)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    content=st.one_of(
        JSON.map(lambda v: json.dumps(v).encode()),
        st.binary(max_size=64),
        st.integers(0, 2000).map(lambda n: json.dumps(dc.dspark_config(dc.SMALL)).encode()[:n]),
    )
)
def test_fuzz_config_file_content(capsys, fuzz_dir, content):
    work = fresh(fuzz_dir)
    (work / "config.json").write_bytes(content)
    run_fuzz(capsys, work)


@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_fuzz_corrupted_safetensors(capsys, fuzz_dir, data):
    work = fresh(fuzz_dir)
    shard = work / "model-00001-of-00002.safetensors"
    raw = bytearray(shard.read_bytes())
    length = int.from_bytes(raw[:8], "little")
    kind = data.draw(st.sampled_from(["length", "truncate", "flip", "header", "index"]))
    if kind == "length":
        raw[:8] = data.draw(st.integers(0, 2**64 - 1)).to_bytes(8, "little")
    elif kind == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    elif kind == "flip":
        for _ in range(data.draw(st.integers(1, 8))):
            i = data.draw(st.integers(8, 8 + length - 1))
            raw[i] = data.draw(st.integers(0, 255))
    elif kind == "header":
        header = json.dumps(data.draw(JSON)).encode()
        raw = bytearray(len(header).to_bytes(8, "little") + header + raw[8 + length :])
    else:
        index = work / "model.safetensors.index.json"
        index.write_bytes(
            data.draw(
                st.one_of(
                    JSON.map(lambda v: json.dumps({"weight_map": v}).encode()),
                    JSON.map(lambda v: json.dumps(v).encode()),
                    st.binary(max_size=32),
                )
            )
        )
    shard.write_bytes(bytes(raw))
    run_fuzz(capsys, work)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    edit=st.tuples(
        st.sampled_from(
            [
                "hybrid_override_pattern",
                "num_hidden_layers",
                "vocab_size",
                "hidden_size",
                "text_config",
                "x",
            ]
        ),
        JSON,
    ),
    whole=st.one_of(st.none(), JSON, st.binary(max_size=16)),
)
def test_fuzz_corrupted_target(capsys, fuzz_dir, edit, whole):
    target = fuzz_dir / "fuzz_target"
    target.mkdir(exist_ok=True)
    if whole is None:
        cfg = dict(dc.target_config(dc.SMALL))
        cfg[edit[0]] = edit[1]
        (target / "config.json").write_text(json.dumps(cfg))
    elif isinstance(whole, bytes):
        (target / "config.json").write_bytes(whole)
    else:
        (target / "config.json").write_text(json.dumps(whole))
    run_fuzz(capsys, fuzz_dir / "pristine", "--target", target)
