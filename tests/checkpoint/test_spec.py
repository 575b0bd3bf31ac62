"""DraftSpec: the validated parse of a draft config (official Nemotron 3.5 schema; generic ones)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import draft_configs as dc
from vllm_nemotron_spec.checkpoint.spec import (
    DraftSpec,
    DraftSpecError,
    get_sample_from_anchor,
    is_nemotron35_draft_config,
    target_num_blocks,
    validate_against_target,
)

D = dc.DELETE


def problems_of(cfg, **kw) -> tuple[str, ...]:
    with pytest.raises(DraftSpecError) as info:
        DraftSpec.from_config(cfg, **kw)
    return info.value.problems


def one_problem(cfg, **kw) -> str:
    problems = problems_of(cfg, **kw)
    assert len(problems) == 1, problems
    return problems[0]


# ---- the official configs ------------------------------------------------------------------


def test_official_dflash():
    s = DraftSpec.from_config(dc.dflash_config(), path="/ckpt/dflash")
    assert (s.path, s.architecture, s.method, s.is_nemotron35) == (
        "/ckpt/dflash",
        "DFlashDraftModel",
        "dflash",
        True,
    )
    assert (
        s.hidden_size,
        s.num_hidden_layers,
        s.num_attention_heads,
        s.num_key_value_heads,
        s.head_dim,
        s.intermediate_size,
        s.vocab_size,
    ) == (2688, 6, 32, 2, 128, 6144, 131072)
    assert (s.causal, s.sliding_window, s.has_attention_sinks) == (False, None, False)
    assert s.layer_types == ("full_attention",) * 6
    assert s.rope_theta == 10000.0
    assert s.rope_scaling == {
        "rope_type": "yarn",
        "factor": 128.0,
        "original_max_position_embeddings": 8192,
    }
    assert s.mask_token_id == 990
    assert s.target_layer_ids == (1, 5, 19, 29, 41, 51)
    assert s.aux_hidden_state_ids == (2, 6, 20, 30, 42, 52)
    assert s.sample_from_anchor is False
    assert s.block_size is None and s.max_num_speculative_tokens is None
    assert s.resolve_num_speculative_tokens(None) == 5  # NVIDIA's vLLM recipe: DFlash @ 5
    assert s.resolve_num_speculative_tokens(12) == 12  # no trained block size to exceed
    assert s.num_query_rows(5) == 6
    assert (s.markov_head_type, s.markov_rank) == (None, None)
    assert (s.has_embed_tokens, s.has_lm_head) == (True, False)
    assert (s.quant_algo, s.quant_group_size, s.is_nvfp4) == ("W4A16_NVFP4", 16, True)
    assert s.warnings == ()


def test_official_dspark():
    s = DraftSpec.from_config(dc.dspark_config())
    assert (s.architecture, s.method, s.is_nemotron35) == ("Qwen3DSparkModel", "dspark", True)
    assert (s.causal, s.sliding_window, s.has_attention_sinks) == (True, 1024, True)
    assert s.layer_types == ("sliding_attention",) * 6
    assert (s.rope_theta, s.rope_scaling) == (10000.0, None)
    assert (s.block_size, s.markov_head_type, s.markov_rank) == (8, "vanilla", 512)
    assert s.sample_from_anchor is False
    assert s.resolve_num_speculative_tokens(None) == 8
    assert s.resolve_num_speculative_tokens(3) == 3
    assert s.num_query_rows(3) == 4  # [b, MASK x 3]
    assert s.warnings == ()


def test_shape_math_matches_the_doc():
    from vllm_nemotron_spec.nvfp4 import format as nvfp4

    mods = dict(DraftSpec.from_config(dc.dspark_config()).linear_modules())
    assert mods["fc"] == (2688, 16128)
    assert nvfp4.packed_shape(mods["fc"]) == (2688, 8064)
    assert nvfp4.scale_shape(mods["fc"]) == (2688, 1008)
    assert mods["markov_head.markov_w2"] == (131072, 512)
    assert nvfp4.packed_shape(mods["markov_head.markov_w2"]) == (131072, 256)
    assert nvfp4.scale_shape(mods["markov_head.markov_w2"]) == (131072, 32)
    assert mods["layers.0.self_attn.q_proj"] == (4096, 2688)
    assert mods["layers.5.self_attn.k_proj"] == (256, 2688)
    assert mods["layers.3.self_attn.o_proj"] == (2688, 4096)
    assert len([m for m in mods if ".mlp." in m]) == 18


def test_layout_agrees_with_the_independent_description():
    for cfg in (dc.dflash_config(), dc.dspark_config(), dc.dspark_config(dc.SMALL)):
        s = DraftSpec.from_config(cfg)
        expected = {(n, k, sh) for n, k, sh in dc.module_layout(cfg)}
        got = {(n, "nvfp4" if s.is_quantized(n) else "dense", sh) for n, sh in s.linear_modules()}
        got |= {(n, "dense", sh) for n, sh in s.dense_tensors()}
        assert got == expected


def test_spec_is_frozen_and_jsonable():
    s = DraftSpec.from_config(dc.dspark_config())
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.block_size = 4
    d = json.loads(json.dumps(s.to_dict()))
    assert d["aux_hidden_state_ids"] == [2, 6, 20, 30, 42, 52]
    assert d["method"] == "dspark"


# ---- the structural check ------------------------------------------------------------------


def test_structural_check():
    assert is_nemotron35_draft_config(dc.dflash_config())
    assert is_nemotron35_draft_config(dc.dspark_config())
    assert is_nemotron35_draft_config(dc.dspark_config(dc.SMALL))
    # BF16 drafts in the same layout are still the layout.
    assert is_nemotron35_draft_config(dc.mutated(dc.dflash_config(), quantization_config=D))
    # Generic drafts.
    assert not is_nemotron35_draft_config(dc.zlab_qwen3_dflash_config())
    assert not is_nemotron35_draft_config(dc.generic_dspark_config())
    for change in (
        {"has_embed_tokens": D},
        {"has_embed_tokens": False},
        {"has_embed_tokens": "true"},
        {"has_lm_head": D},
        {"has_lm_head": True},
        {"eagle_aux_hidden_state_layer_ids": D},
        {"dflash_config": D},
        {"dflash_config": []},
        {"architectures": ["LlamaForCausalLMEagle3"]},
    ):
        assert not is_nemotron35_draft_config(dc.mutated(dc.dflash_config(), **change)), change
    for junk in (None, [], "x", 3, {"architectures": "DFlashDraftModel"}):
        assert is_nemotron35_draft_config(junk) is False


def test_damaged_nemotron_config_is_reported_not_downgraded():
    # Wrong aux ids keep the structural markers: an error, not the generic path.
    cfg = dc.mutated(dc.dflash_config(), eagle_aux_hidden_state_layer_ids=[1, 5, 19, 29, 41, 51])
    assert is_nemotron35_draft_config(cfg)
    assert "must be target_layer_ids + 1 = [2, 6, 20, 30, 42, 52]" in one_problem(cfg)


def test_generic_zlab_dflash():
    s = DraftSpec.from_config(dc.zlab_qwen3_dflash_config())
    assert (s.method, s.is_nemotron35, s.sample_from_anchor) == ("dflash", False, False)
    assert (s.has_embed_tokens, s.has_lm_head, s.quant_algo) == (False, False, None)
    assert s.mask_token_id == 151669
    assert s.aux_hidden_state_ids == (2, 10, 18, 26, 34)
    assert (s.block_size, s.max_num_speculative_tokens) == (16, 15)
    assert s.resolve_num_speculative_tokens(None) == 15
    assert s.rope_theta == 1e6 and not s.causal
    assert s.is_quantized("fc") is False
    validate_against_target(s, {"num_hidden_layers": 36, "hidden_size": 4096, "vocab_size": 151936})
    with pytest.raises(DraftSpecError, match="num_target_layers` is 36 but the target has 40"):
        validate_against_target(
            s, {"num_hidden_layers": 40, "hidden_size": 4096, "vocab_size": 151936}
        )


def test_generic_dspark_defaults_to_anchor_layout():
    s = DraftSpec.from_config(dc.generic_dspark_config())
    assert (s.method, s.is_nemotron35, s.sample_from_anchor) == ("dspark", False, True)
    assert s.num_query_rows(7) == 7
    assert s.resolve_num_speculative_tokens(None) == 7


def test_nemotron_markers_without_aux_ids_warn():
    cfg = dc.mutated(dc.dflash_config(), eagle_aux_hidden_state_layer_ids=D)
    s = DraftSpec.from_config(cfg)
    assert not s.is_nemotron35
    assert any("look like the Nemotron 3.5 layout" in w for w in s.warnings)


# ---- sample_from_anchor --------------------------------------------------------------------


def test_get_sample_from_anchor():
    assert get_sample_from_anchor({}) is True
    assert get_sample_from_anchor({"sample_from_anchor": False}) is False
    assert (
        get_sample_from_anchor(
            {"sample_from_anchor": True, "dflash_config": {"sample_from_anchor": True}}
        )
        is True
    )
    assert get_sample_from_anchor(dc.dspark_config()) is False
    with pytest.raises(DraftSpecError, match="set only inside dflash_config .*ambiguous"):
        get_sample_from_anchor({"dflash_config": {"sample_from_anchor": False}})
    with pytest.raises(DraftSpecError, match=r"disagrees with the top-level `sample_from_anchor`"):
        get_sample_from_anchor(
            {"sample_from_anchor": True, "dflash_config": {"sample_from_anchor": False}}
        )
    with pytest.raises(DraftSpecError, match='expected true or false, found string "false"'):
        get_sample_from_anchor({"sample_from_anchor": "false"})
    with pytest.raises(DraftSpecError, match="expected a JSON object"):
        get_sample_from_anchor([])


def test_nemotron_dspark_without_anchor_flag_warns():
    cfg = dc.mutated(
        dc.dspark_config(),
        sample_from_anchor=D,
        dflash_config__sample_from_anchor=D,
        dspark_bonus_anchor=D,
    )
    s = DraftSpec.from_config(cfg)
    assert s.sample_from_anchor is True and s.num_query_rows(3) == 3
    assert any("`sample_from_anchor` is absent" in w for w in s.warnings)


def test_dspark_anchor_only_in_dflash_config_is_an_error():
    cfg = dc.mutated(dc.dspark_config(), sample_from_anchor=D)
    assert "ambiguous" in one_problem(cfg)


def test_dflash_never_samples_from_anchor():
    problems = problems_of(
        dc.mutated(
            dc.dflash_config(), sample_from_anchor=True, dflash_config__sample_from_anchor=True
        )
    )
    assert [p.split(":")[0] for p in problems] == [
        "`sample_from_anchor`",
        "`dflash_config.sample_from_anchor`",
    ]
    assert all("DFlash drafts never sample from the anchor" in p for p in problems)
    # For DFlash a dflash_config-only value is not ambiguous.
    s = DraftSpec.from_config(dc.mutated(dc.dflash_config(), sample_from_anchor=D))
    assert s.sample_from_anchor is False


# ---- gamma ---------------------------------------------------------------------------------


def test_gamma_beyond_block_size():
    s = DraftSpec.from_config(dc.dspark_config())
    with pytest.raises(DraftSpecError) as info:
        s.resolve_num_speculative_tokens(9)
    msg = str(info.value)
    assert "num_speculative_tokens=9 exceeds the trained block_size 8" in msg
    assert "acceptance collapses" in msg and "use at most 8" in msg
    for bad in (0, -1, True, 2.0, "3"):
        with pytest.raises(DraftSpecError, match="expected a positive integer"):
            s.resolve_num_speculative_tokens(bad)
        with pytest.raises(DraftSpecError):
            s.num_query_rows(bad)
    z = DraftSpec.from_config(dc.zlab_qwen3_dflash_config())
    with pytest.raises(DraftSpecError, match="block_size 16 \\(one row is the anchor\\)"):
        z.resolve_num_speculative_tokens(16)


def test_generic_dflash_without_block_size_needs_gamma():
    s = DraftSpec.from_config(dc.mutated(dc.zlab_qwen3_dflash_config(), block_size=D))
    assert s.resolve_num_speculative_tokens(4) == 4
    with pytest.raises(DraftSpecError, match="pass num_speculative_tokens explicitly"):
        s.resolve_num_speculative_tokens(None)


# ---- quantization --------------------------------------------------------------------------


def test_is_quantized():
    s = DraftSpec.from_config(dc.dspark_config())
    assert s.is_quantized("fc")
    assert s.is_quantized("layers.0.mlp.up_proj")
    assert s.is_quantized("model.layers.5.mlp.down_proj")
    assert s.is_quantized("layers.2.mlp.gate_up_proj")
    assert s.is_quantized("markov_head.markov_w2")
    assert not s.is_quantized("layers.0.self_attn.q_proj")
    assert not s.is_quantized("layers.0.self_attn.qkv_proj")
    assert not s.is_quantized("embed_tokens")
    assert not s.is_quantized("markov_head.markov_w1")
    assert s.exclusion_pattern("layers.3.self_attn.o_proj") == "layers.*.self_attn.o_proj"
    mixed = DraftSpec.from_config(
        dc.mutated(dc.dspark_config(), quantization_config__ignore=["layers.*.self_attn.q_proj"])
    )
    with pytest.raises(DraftSpecError, match="shards are quantized differently"):
        mixed.is_quantized("layers.0.self_attn.qkv_proj")
    bf16 = DraftSpec.from_config(dc.mutated(dc.dspark_config(), quantization_config=D))
    assert not bf16.is_quantized("fc") and bf16.quant_algo is None


def test_quantization_config_forms():
    legacy = dc.mutated(
        dc.dflash_config(),
        quantization_config={
            "producer": {"name": "modelopt"},
            "quantization": {
                "quant_algo": "W4A16_NVFP4",
                "group_size": 16,
                "exclude_modules": ["layers.*.self_attn*", "embed_tokens"],
            },
        },
    )
    s = DraftSpec.from_config(legacy)
    assert s.quant_algo == "W4A16_NVFP4" and s.quant_method == "modelopt"
    assert s.is_quantized("fc") and not s.is_quantized("layers.1.self_attn.v_proj")
    groups = dc.mutated(
        dc.dflash_config(),
        quantization_config__group_size=D,
        quantization_config__config_groups={"g": {"weights": {"group_size": 32}}},
    )
    assert "NVFP4 stores one scale per 16 inputs, found 32" in one_problem(groups)


def test_hf_quant_config_file_fallback(tmp_path):
    cfg = dc.mutated(dc.dflash_config(), quantization_config=D)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "hf_quant_config.json").write_text(
        json.dumps(
            {
                "producer": {"name": "modelopt"},
                "quantization": {
                    "quant_algo": "W4A16_NVFP4",
                    "group_size": 16,
                    "exclude_modules": ["layers.*.self_attn*"],
                },
            }
        )
    )
    s = DraftSpec.from_pretrained(tmp_path)
    assert s.quant_algo == "W4A16_NVFP4" and s.path == str(tmp_path)


def test_markov_rank_and_group_size():
    p = one_problem(dc.mutated(dc.dspark_config(), markov_rank=500))
    assert p == (
        "markov_head.markov_w2: NVFP4 (not excluded by quantization_config) needs "
        "in_features to be a multiple of the group size 16, but markov_rank 500 is not"
    )
    # Excluded markov_w2 (BF16) or an unquantized draft: any rank.
    excluded = dc.mutated(
        dc.dspark_config(),
        markov_rank=500,
        quantization_config__ignore=(
            dc.dspark_config()["quantization_config"]["ignore"] + ["markov_head.markov_w2"]
        ),
    )
    assert DraftSpec.from_config(excluded).markov_rank == 500
    assert (
        DraftSpec.from_config(
            dc.mutated(dc.dspark_config(), markov_rank=500, quantization_config=D)
        ).markov_rank
        == 500
    )


# ---- validation errors ---------------------------------------------------------------------

CASES = [
    ("dspark", {"hidden_size": D}, "`hidden_size`: missing (expected a positive integer)"),
    (
        "dspark",
        {"hidden_size": "2688"},
        '`hidden_size`: expected a positive integer, found string "2688"',
    ),
    (
        "dflash",
        {"num_hidden_layers": 0},
        "`num_hidden_layers`: expected a positive integer, found integer 0",
    ),
    ("dflash", {"head_dim": D}, "`head_dim`: missing"),
    ("dflash", {"num_hidden_layers": 10**12}, "is not a draft's layer count (at most 1024"),
    (
        "dflash",
        {"num_key_value_heads": 3},
        "`num_key_value_heads`: 3 does not divide num_attention_heads 32",
    ),
    ("dflash", {"rms_norm_eps": -1}, "`rms_norm_eps`: expected a positive finite number"),
    ("dflash", {"architectures": []}, "`architectures`: expected a non-empty list"),
    ("dflash", {"architectures": ["LlamaForCausalLM"]}, "is neither a DFlash"),
    (
        "dflash",
        {"markov_rank": 512},
        "is a DFlash draft but the config declares a DSpark Markov head",
    ),
    (
        "dspark",
        {"markov_head_type": "mlp"},
        '`markov_head_type`: the Nemotron 3.5 DSpark draft needs "vanilla", found "mlp"',
    ),
    ("dspark", {"markov_head_type": D}, "`markov_head_type`: missing"),
    ("dspark", {"markov_rank": D}, "`markov_rank`: missing"),
    ("dspark", {"block_size": D}, "`block_size`: missing"),
    ("dspark", {"block_size": 8.0}, "`block_size`: expected a positive integer, found number 8.0"),
    (
        "dspark",
        {"dflash_config__block_size": 6},
        "block sizes disagree: `block_size` = 8, `dflash_config.block_size` = 6",
    ),
    (
        "dflash",
        {"eagle_aux_hidden_state_layer_ids": [2, 6, 20, 30, 42, 53]},
        "must be target_layer_ids + 1",
    ),
    (
        "dflash",
        {"dflash_config__target_layer_ids": [1, 5, 19, 29, 41, 50]},
        "target layer ids disagree",
    ),
    (
        "dflash",
        {"target_layer_ids": [1, 1, 19, 29, 41, 51]},
        "expected a non-empty list of distinct non-negative integers",
    ),
    (
        "dflash",
        {"target_layer_ids": D, "dflash_config__target_layer_ids": D},
        "`target_layer_ids`: missing",
    ),
    ("dflash", {"num_aux_layers": 5}, "`num_aux_layers` is 5 but target_layer_ids has 6 entries"),
    ("dflash", {"mask_token_id": 991}, "mask token ids disagree"),
    (
        "dflash",
        {"mask_token_id": D, "pard_token": D, "dflash_config__mask_token_id": D},
        "`mask_token_id`: missing",
    ),
    (
        "dflash",
        {"mask_token_id": 200000, "pard_token": 200000, "dflash_config__mask_token_id": 200000},
        "`mask_token_id`: 200000 is not below vocab_size 131072",
    ),
    (
        "dflash",
        {"is_causal": True},
        "`dflash_config.causal` (false) disagrees with the top-level `is_causal` (true)",
    ),
    (
        "dspark",
        {"dflash_config__swa_window_size": 512},
        "`dflash_config.swa_window_size` (512) disagrees with the top-level `sliding_window` (1024)",
    ),
    (
        "dspark",
        {"dflash_config__swa_window_size": D, "sliding_window": D},
        "`sliding_window`: missing",
    ),
    (
        "dspark",
        {"dflash_config__use_swa": False},
        "`dflash_config.use_swa` is false but `layer_types` are ['sliding_attention']",
    ),
    (
        "dspark",
        {"attention_sink_bias": False},
        "`dflash_config.attention_sink_bias` (true) disagrees",
    ),
    (
        "dspark",
        {"dspark_bonus_anchor": False},
        "`dspark_bonus_anchor` (false) contradicts `sample_from_anchor` (false)",
    ),
    (
        "dspark",
        {"dflash_config__sample_from_anchor": True},
        "`dflash_config.sample_from_anchor` (true) disagrees",
    ),
    ("dspark", {"sample_from_anchor": "no"}, "`sample_from_anchor`: expected true or false"),
    (
        "dflash",
        {"layer_types": ["full_attention"] * 5},
        "`layer_types` has 5 entries but num_hidden_layers is 6",
    ),
    (
        "dflash",
        {"layer_types": ["full_attention"] * 5 + ["sliding_attention"]},
        "one attention type for all layers",
    ),
    (
        "dflash",
        {"layer_types": ["linear_attention"] * 6},
        "unknown attention type(s) ['linear_attention']",
    ),
    (
        "dflash",
        {"rope_scaling": {"rope_type": "yarn", "factor": 128.0}},
        "`rope_scaling.original_max_position_embeddings`: missing",
    ),
    ("dflash", {"rope_theta": D}, "`rope_theta`: missing"),
    (
        "dflash",
        {"rope_parameters": {"rope_theta": 5e5}},
        "`rope_theta` (10000) disagrees with `rope_parameters.rope_theta` (500000)",
    ),
    ("dflash", {"has_embed_tokens": "yes"}, "`has_embed_tokens`: expected true or false"),
    ("dflash", {"hidden_act": "gelu"}, "SiLU"),
    (
        "dflash",
        {"quantization_config": []},
        "`quantization_config`: expected an object, found array []",
    ),
    ("dflash", {"quantization_config__quant_algo": D}, "`quantization_config.quant_algo`: missing"),
    (
        "dflash",
        {"quantization_config__ignore": "embed_tokens"},
        "`quantization_config.ignore`: expected a list of strings",
    ),
    (
        "dflash",
        {"quantization_config__ignore": [""]},
        "an empty pattern would exclude every module",
    ),
    ("dflash", {"quantization_config__exclude_modules": ["fc"]}, "list different modules"),
    ("dflash", {"dflash_config": "causal"}, "`dflash_config`: expected an object"),
    (
        "dflash",
        {"draft_vocab_size": 32000},
        "the Nemotron 3.5 drafts use the full target vocabulary",
    ),
]


@pytest.mark.parametrize("kind,change,expected", CASES, ids=[str(c[1]) for c in CASES])
def test_validation_error(kind, change, expected):
    cfg = dc.mutated(dc.dspark_config() if kind == "dspark" else dc.dflash_config(), **change)
    problems = problems_of(cfg)
    assert any(expected in p for p in problems), problems


def test_all_problems_are_reported_at_once():
    cfg = dc.mutated(
        dc.dspark_config(),
        hidden_size=D,
        markov_head_type="mlp",
        mask_token_id=7,
        dflash_config__causal="yes",
    )
    with pytest.raises(DraftSpecError) as info:
        DraftSpec.from_config(cfg, path="/d")
    assert len(info.value.problems) == 4
    text = str(info.value)
    assert text.startswith("draft /d: 4 problems:\n  - ")
    for needle in (
        "`hidden_size`: missing",
        '"mlp"',
        "mask token ids disagree",
        '`dflash_config.causal`: expected true or false, found string "yes"',
    ):
        assert needle in text


def test_non_object_config():
    for junk in ([], "x", 1, None):
        with pytest.raises(DraftSpecError, match="expected a JSON object"):
            DraftSpec.from_config(junk)


# ---- against the target --------------------------------------------------------------------


def test_against_target_ok_and_last_id():
    # aux id 52 (= after block 51, before the final norm) is allowed for a 52-block target.
    s = DraftSpec.from_config(dc.dflash_config(), target_config=dc.target_config())
    assert s.aux_hidden_state_ids[-1] == 52 == target_num_blocks(dc.target_config())
    small = DraftSpec.from_config(
        dc.dspark_config(dc.SMALL), target_config=dc.target_config(dc.SMALL)
    )
    assert small.aux_hidden_state_ids == (1, 4)


def test_against_target_errors():
    s = DraftSpec.from_config(dc.dflash_config())
    t = dc.target_config()
    with pytest.raises(DraftSpecError) as info:
        validate_against_target(s, dict(t, hybrid_override_pattern="M" * 50, num_hidden_layers=50))
    assert info.value.problems == (
        "aux hidden state id 52 (target_layer_ids[5] = 51, + 1) is beyond the target's 50 "
        "blocks: aux id k is the residual stream after block k-1, so ids run 1..50 (50 = after "
        "the last block, before the final norm)",
    )
    with pytest.raises(DraftSpecError) as info:
        validate_against_target(s, dict(t, vocab_size=131073, hidden_size=4096))
    text = str(info.value)
    assert "the draft has 131072 but the target has 131073" in text
    assert "fc expects aux hidden states of width 2688 but the target's hidden_size is 4096" in text
    with pytest.raises(DraftSpecError, match="has 52 blocks but `target.num_hidden_layers` is 50"):
        validate_against_target(s, dict(t, num_hidden_layers=50))
    # No pattern: num_hidden_layers counts the blocks.
    no_pattern = {k: v for k, v in t.items() if k != "hybrid_override_pattern"}
    validate_against_target(s, no_pattern)
    with pytest.raises(DraftSpecError, match="beyond the target's 51 blocks"):
        validate_against_target(s, dict(no_pattern, num_hidden_layers=51))
    with pytest.raises(
        DraftSpecError,
        match="missing `layers_block_type`, `hybrid_override_pattern` and `num_hidden_layers`",
    ):
        validate_against_target(s, {"vocab_size": 131072, "hidden_size": 2688})
    with pytest.raises(DraftSpecError, match="target config: expected a JSON object"):
        validate_against_target(s, [])
    with pytest.raises(DraftSpecError, match="beyond the target's 40 blocks"):
        DraftSpec.from_config(
            dc.dflash_config(),
            target_config=dict(t, hybrid_override_pattern="M" * 40, num_hidden_layers=40),
        )


# ---- from_pretrained -----------------------------------------------------------------------


def test_from_pretrained_errors(tmp_path):
    with pytest.raises(DraftSpecError, match="no such file or directory"):
        DraftSpec.from_pretrained(tmp_path / "nope")
    with pytest.raises(DraftSpecError, match="no config.json"):
        DraftSpec.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text('{"hidden_size": 2688,')
    with pytest.raises(DraftSpecError, match="invalid JSON at line 1 column"):
        DraftSpec.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(
        DraftSpecError, match="expected a JSON object at the top level, found array"
    ):
        DraftSpec.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(DraftSpecError, match="not UTF-8"):
        DraftSpec.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(DraftSpecError, match="nested too deeply"):
        DraftSpec.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text('{"hidden_size": 1' + "0" * 5000 + "}")
    with pytest.raises(DraftSpecError, match="invalid JSON"):
        DraftSpec.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(dc.dspark_config()))
    assert DraftSpec.from_pretrained(tmp_path / "config.json").method == "dspark"


# ---- fuzz: the parser raises DraftSpecError or returns a spec, nothing else ------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)
KEYS = sorted(
    set(dc.dspark_config())
    | set(dc.dflash_config())
    | {"rope_parameters", "is_causal", "block_size"}
)


@st.composite
def corrupted_configs(draw):
    cfg = draw(
        st.sampled_from(
            [
                dc.dflash_config,
                dc.dspark_config,
                dc.zlab_qwen3_dflash_config,
                dc.generic_dspark_config,
            ]
        )
    )()
    for _ in range(draw(st.integers(1, 4))):
        where = cfg
        nested = draw(
            st.sampled_from([None, "dflash_config", "quantization_config", "rope_scaling"])
        )
        if nested and isinstance(cfg.get(nested), dict):
            where = cfg[nested]
        keys = sorted(where) or ["x"]
        key = draw(st.sampled_from(keys + KEYS))
        action = draw(st.sampled_from(["delete", "json", "int", "list"]))
        if action == "delete":
            where.pop(key, None)
        elif action == "json":
            where[key] = draw(JSON)
        elif action == "int":
            where[key] = draw(st.integers(-3, 2**20))
        else:
            where[key] = draw(st.lists(st.integers(-2, 60), max_size=7))
    return cfg


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(corrupted_configs(), st.one_of(st.none(), st.integers(-2, 20)))
def test_fuzz_parser_never_crashes(cfg, gamma):
    try:
        spec = DraftSpec.from_config(cfg, target_config=dc.target_config())
    except DraftSpecError as exc:
        assert exc.problems and all(isinstance(p, str) and p for p in exc.problems)
        return
    spec.linear_modules()
    spec.dense_tensors()
    json.dumps(spec.to_dict())
    try:
        spec.resolve_num_speculative_tokens(gamma)
    except DraftSpecError:
        pass
