"""benchmarks/harness/floors.py: the bytes each part of a step must read, checked against sums
done by hand on small shapes, and the expected number of distinct experts."""

from __future__ import annotations

import math

import pytest

from benchmarks.harness import floors


def test_distinct_experts_limits_and_formula():
    assert floors.distinct_experts(128, 6, 1) == pytest.approx(6.0)
    assert floors.distinct_experts(128, 6, 0) == 0.0
    assert floors.distinct_experts(128, 128, 3) == pytest.approx(128.0)
    assert floors.distinct_experts(128, 6, 10_000) == pytest.approx(128.0)
    # two tokens: 6 + 6 * (122/128) expected distinct (the second token's new ones)
    assert floors.distinct_experts(128, 6, 2) == pytest.approx(6 + 6 * 122 / 128)
    with pytest.raises(ValueError, match="top_k must be in 1..8"):
        floors.distinct_experts(8, 9, 1)


SMALL = floors.TargetShape(
    hidden=16, vocab=100, pattern="ME*", experts=4, top_k=2, moe_intermediate=8,
    shared_intermediate=32, mamba_heads=2, mamba_head_dim=4, ssm_state=8, n_groups=1,
    conv_kernel=4, attn_heads=4, kv_heads=2, head_dim=4,
)  # fmt: skip


def test_target_bytes_by_hand():
    got = floors.target_bytes(SMALL, batch=1, num_spec=0, context=10, kv_bytes=1.0)
    # one token: top_k=2 experts, each up+down 2*8*16 values at 0.5625 bytes
    assert got["routed_experts"] == pytest.approx(2 * 2 * 8 * 16 * floors.NVFP4_BYTES)
    assert got["shared_experts"] == pytest.approx(2 * 32 * 16 * floors.NVFP4_BYTES + 4 * 16 * 2)
    d_inner, conv_dim = 8, 8 + 2 * 8
    in_proj = 16 * (2 * d_inner + 2 * 8 + 2)
    assert got["mamba_weights"] == in_proj + d_inner * 16 + conv_dim * 4 * 2  # fp8 projections
    state = 2 * 4 * 8 * 4  # fp32
    assert got["mamba_state"] == state * 2 + 2 * conv_dim * 3 * 2  # read + one write, conv window
    assert got["attention_weights"] == (16 * (4 + 4) * 4 + 16 * 16) * 2
    assert got["kv_cache"] == 10 * 2 * 2 * 4
    assert got["lm_head"] == 100 * 16 * 2
    assert got["embedding_rows"] == 16 * 2


def test_speculation_multiplies_tokens_and_state_writes():
    one = floors.target_bytes(SMALL, batch=2, num_spec=3, context=10, kv_bytes=1.0)
    tokens = 2 * 4
    assert one["routed_experts"] == pytest.approx(
        floors.distinct_experts(4, 2, tokens) * 2 * 8 * 16 * floors.NVFP4_BYTES
    )
    conv_state = 24 * (3 + 3) * 2
    assert one["mamba_state"] == 2 * (256 * (1 + 4) + 2 * conv_state)


def test_replay_ssm_reads_the_state_once_whatever_k():
    """vLLM's ReplaySSM stores no per-position states: only the state's one read counts, the
    convolution window as before, everything else unchanged."""
    conv_state = 24 * (3 + 3) * 2
    plain = floors.target_bytes(SMALL, batch=2, num_spec=3, context=10, kv_bytes=1.0)
    replay = floors.target_bytes(SMALL, 2, 3, 10, 1.0, replay_ssm=True)
    assert replay["mamba_state"] == 2 * (256 + 2 * conv_state)
    assert {k: v for k, v in replay.items() if k != "mamba_state"} == {
        k: v for k, v in plain.items() if k != "mamba_state"
    }
    steps = [floors.step_floors(SMALL, None, 2, 3, 10, replay_ssm=r) for r in (False, True)]
    saved = steps[0]["target"]["total_bytes"] - steps[1]["target"]["total_bytes"]
    assert saved == 2 * 256 * 4  # the k + 1 = 4 per-position writes of two requests


def test_bf16_target_reads_two_bytes_per_value():
    bf16 = floors.TargetShape(**{**SMALL.__dict__, "experts_dtype": "bfloat16",
                                 "mamba_proj_dtype": "bfloat16"})  # fmt: skip
    a = floors.target_bytes(SMALL, 1, 0, 10, 1.0)
    b = floors.target_bytes(bf16, 1, 0, 10, 1.0)
    assert b["routed_experts"] / a["routed_experts"] == pytest.approx(2 / floors.NVFP4_BYTES)
    assert b["lm_head"] == a["lm_head"]


# hidden 16, vocab 100, 2 layers, 4 heads, 2 KV heads of 4, MLP 32, 3 aux layers, rank 16, window 8
DRAFT_SIZES = dict(hidden=16, layers=2, heads=4, kv_heads=2, head_dim=4, inter=32, vocab=100,
                   target_ids=[0, 1, 2], mask=99, window=8, block=4, rank=16)  # fmt: skip


def test_draft_bytes_dspark_reads_markov_w2_once_per_draft_and_its_window_only():
    from tests.draft_configs import dflash_config, dspark_config
    from vllm_nemotron_spec.checkpoint.spec import DraftSpec

    d = DraftSpec.from_config(dspark_config(DRAFT_SIZES))
    got = floors.draft_bytes(d, batch=2, num_spec=3, context=100, kv_bytes=1.0)
    assert got["markov_w2"] == pytest.approx(3 * 100 * 16 * floors.NVFP4_BYTES)
    assert got["kv_cache"] == 2 * 2 * (8 * 2 * 2 * 4)  # layers x batch x window only
    assert got["fc"] == pytest.approx(16 * 3 * 16 * floors.NVFP4_BYTES)
    dflash = DraftSpec.from_config(dflash_config(DRAFT_SIZES))
    assert "markov_w2" not in floors.draft_bytes(dflash, 2, 3, 100, 1.0)


def test_step_floors_totals_and_bandwidth():
    out = floors.step_floors(SMALL, None, 1, 0, 10, bandwidth_tbs=2.0)
    assert "draft" not in out
    total = out["target"]["total_bytes"] + out["sampling"]["total_bytes"]
    assert out["step"]["total_bytes"] == pytest.approx(total)
    assert out["step"]["floor_ms"] == pytest.approx(total / 2e12 * 1e3)
    assert floors.floor_ms(4.3e9) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="bandwidth must be positive"):
        floors.floor_ms(1, 0)


def test_shapes_from_config_files():
    from benchmarks.harness import models

    cfg = models.target_config(models.TINY_SHAPE, quantized=True)
    t = floors.TargetShape.from_config(cfg, quantized=True)
    assert (t.experts, t.top_k, t.shared_intermediate) == (8, 2, 128)
    assert t.pattern.count("E") == 3 and t.ssm_state_dtype == "float32"
    assert math.isclose(floors.DTYPE_BYTES[t.experts_dtype], floors.NVFP4_BYTES)


def test_bandwidth_follows_the_gpu_and_says_when_it_guesses():
    assert floors.bandwidth_for("NVIDIA H200") == (4.3, "H200")
    assert floors.bandwidth_for("NVIDIA H100 80GB HBM3") == (3.0, "H100")
    tbs, source = floors.bandwidth_for("NVIDIA A10G")
    assert tbs == 4.3 and "no figure for NVIDIA A10G" in source
    assert "no figure for this machine" in floors.bandwidth_for(None)[1]
