"""The tiny DFlash / DSpark drafts: official config schema, tensor layout, NVFP4 packing."""

from __future__ import annotations

import fnmatch
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from vllm_nemotron_spec.checkpoint import layout
from vllm_nemotron_spec.nvfp4 import format as nvfp4
from vllm_nemotron_spec.tiny import drafts
from vllm_nemotron_spec.tiny.tokenizer import MASK_ID

KINDS = ("dflash", "dspark")


def _config(family, kind) -> dict:
    return json.loads((family.draft(kind) / "config.json").read_text())


def _target_config(family) -> dict:
    return json.loads((family.target / "config.json").read_text())


def _raw_tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _is(value, typ) -> bool:
    """Exact type check (a bool is not an int, an int is not a float)."""
    return type(value) is typ


# ------------------------------------------------------------------------------------------
# config.json
# ------------------------------------------------------------------------------------------

# Fields every official Nemotron 3.5 draft config carries, with their JSON types.
COMMON_FIELDS = {
    "architectures": list,
    "model_type": str,
    "attention_bias": bool,
    "attention_dropout": float,
    "bos_token_id": int,
    "eos_token_id": int,
    "head_dim": int,
    "hidden_act": str,
    "hidden_size": int,
    "initializer_range": float,
    "intermediate_size": int,
    "max_position_embeddings": int,
    "num_attention_heads": int,
    "num_hidden_layers": int,
    "num_key_value_heads": int,
    "rms_norm_eps": float,
    "rope_theta": float,
    "tie_word_embeddings": bool,
    "torch_dtype": str,
    "use_cache": bool,
    "vocab_size": int,
    "layer_types": list,
    "use_sliding_window": bool,
    "max_window_layers": int,
    "has_embed_tokens": bool,
    "has_lm_head": bool,
    "target_layer_ids": list,
    "eagle_aux_hidden_state_layer_ids": list,
    "num_aux_layers": int,
    "mask_token_id": int,
    "pard_token": int,
    "sample_from_anchor": bool,
    "dflash_config": dict,
    "quantization_config": dict,
}
DSPARK_FIELDS = {
    "sliding_window": int,
    "block_size": int,
    "dspark_bonus_anchor": bool,
    "markov_head_type": str,
    "markov_rank": int,
}


@pytest.mark.parametrize("kind", KINDS)
def test_config_has_every_official_field_with_its_type(tiny_family, kind):
    config = _config(tiny_family, kind)
    fields = dict(COMMON_FIELDS)
    if kind == "dspark":
        fields.update(DSPARK_FIELDS)
    for name, typ in fields.items():
        assert name in config, f"{kind} config.json lacks {name}"
        assert _is(config[name], typ), (
            f"{kind} {name}: expected {typ.__name__}, found {config[name]!r}"
        )


@pytest.mark.parametrize("kind", KINDS)
def test_config_common_values(tiny_family, kind):
    config = _config(tiny_family, kind)
    target = _target_config(tiny_family)
    num_blocks = len(target["hybrid_override_pattern"])
    assert config["model_type"] == "qwen3"
    assert config["has_embed_tokens"] is True
    assert config["has_lm_head"] is False
    assert config["tie_word_embeddings"] is False
    assert config["torch_dtype"] == "bfloat16"
    assert config["hidden_act"] == "silu"
    assert config["hidden_size"] == target["hidden_size"]
    assert config["vocab_size"] == target["vocab_size"] == 1024
    assert config["num_hidden_layers"] == 6
    assert config["num_key_value_heads"] == 2
    assert config["num_attention_heads"] % config["num_key_value_heads"] == 0
    assert config["head_dim"] in (32, 64)
    assert config["intermediate_size"] % 16 == 0
    assert config["rope_theta"] == 10000.0
    # aux layers: 6 ids spread over the target with the LAST block included; aux ids = ids + 1
    ids = config["target_layer_ids"]
    assert len(ids) == config["num_aux_layers"] == 6
    assert all(_is(i, int) for i in ids)
    assert ids == sorted(set(ids)) and ids[0] >= 1 and ids[-1] == num_blocks - 1
    assert config["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in ids]
    assert config["eagle_aux_hidden_state_layer_ids"][-1] == num_blocks
    assert config["dflash_config"]["target_layer_ids"] == ids
    # mask token
    assert config["mask_token_id"] == config["pard_token"] == MASK_ID
    assert config["dflash_config"]["mask_token_id"] == MASK_ID
    # bonus anchor layout at the top level AND inside dflash_config
    assert config["sample_from_anchor"] is False
    assert config["dflash_config"]["sample_from_anchor"] is False
    assert len(config["layer_types"]) == config["num_hidden_layers"]


def test_dflash_config_values(tiny_family):
    config = _config(tiny_family, "dflash")
    ids = config["target_layer_ids"]
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["layer_types"] == ["full_attention"] * 6
    assert config["use_sliding_window"] is False
    assert config.get("sliding_window") is None
    assert "block_size" not in config
    rope = config["rope_scaling"]
    assert rope["rope_type"] == "yarn"
    assert _is(rope["factor"], float) and rope["factor"] > 1
    assert _is(rope["original_max_position_embeddings"], int)
    assert (
        rope["factor"] * rope["original_max_position_embeddings"]
        == config["max_position_embeddings"]
    )
    assert config["dflash_config"] == {
        "causal": False,
        "mask_token_id": MASK_ID,
        "target_layer_ids": ids,
        "use_swa": False,
        "sample_from_anchor": False,
        "attention_sink_bias": False,
    }


def test_dspark_config_values(tiny_family):
    config = _config(tiny_family, "dspark")
    ids = config["target_layer_ids"]
    assert config["architectures"] == ["Qwen3DSparkModel"]
    assert config["layer_types"] == ["sliding_attention"] * 6
    assert config["use_sliding_window"] is True
    assert config["sliding_window"] == 64
    assert config.get("rope_scaling") is None
    assert config["block_size"] == 8
    assert config["dspark_bonus_anchor"] is True
    assert config["markov_head_type"] == "vanilla"
    assert config["markov_rank"] == 32 and config["markov_rank"] % 16 == 0
    assert config["dflash_config"] == {
        "causal": True,
        "mask_token_id": MASK_ID,
        "target_layer_ids": ids,
        "use_swa": True,
        "swa_window_size": 64,
        "sample_from_anchor": False,
        "attention_sink_bias": True,
    }


@pytest.mark.parametrize("kind", KINDS)
def test_quantization_configs(tiny_family, kind):
    config = _config(tiny_family, kind)
    q = config["quantization_config"]
    assert q["quant_method"] == "modelopt"
    assert q["quant_algo"] == "W4A16_NVFP4"
    assert q["group_size"] == 16
    assert q["config_groups"]["group_0"]["weights"] == {
        "dynamic": False,
        "num_bits": 4,
        "type": "float",
        "group_size": 16,
    }
    assert (
        "input_activations" not in q["config_groups"]["group_0"]
    )  # W4A16: activations unquantized
    for module in ("embed_tokens", "hidden_norm", "norm", "layers.*.self_attn*"):
        assert module in q["ignore"]
    assert ("markov_head.markov_w1" in q["ignore"]) == (kind == "dspark")
    hf_quant = json.loads((tiny_family.draft(kind) / "hf_quant_config.json").read_text())
    assert hf_quant["producer"]["name"] == "modelopt"
    assert hf_quant["quantization"] == {
        "quant_algo": "W4A16_NVFP4",
        "kv_cache_quant_algo": None,
        "group_size": 16,
        "exclude_modules": q["ignore"],
    }


@pytest.mark.parametrize("kind", KINDS)
def test_transformers_reads_config(tiny_family, kind):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(tiny_family.draft(kind)))
    assert cfg.model_type == "qwen3"
    assert cfg.num_hidden_layers == 6
    assert cfg.mask_token_id == MASK_ID
    assert cfg.dflash_config["causal"] is (kind == "dspark")
    if kind == "dspark":
        assert cfg.sliding_window == 64
        assert cfg.layer_types == ["sliding_attention"] * 6
    else:
        rope = cfg.rope_parameters
        assert rope["rope_type"] == "yarn" and rope["factor"] == 16.0
        assert rope["original_max_position_embeddings"] == 256


@pytest.mark.parametrize("kind", KINDS)
def test_vllm_modelopt_accepts_quantization_config(tiny_family, kind):
    from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config

    q = _config(tiny_family, kind)["quantization_config"]
    parsed = ModelOptNvFp4Config.from_config(q)
    assert parsed.exclude_modules == q["ignore"]
    hf_quant = json.loads((tiny_family.draft(kind) / "hf_quant_config.json").read_text())
    assert ModelOptNvFp4Config.from_config(hf_quant).exclude_modules == q["ignore"]


# ------------------------------------------------------------------------------------------
# tensors
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_tensor_names_dtypes_shapes(tiny_family, kind):
    config = _config(tiny_family, kind)
    raw = _raw_tensors(tiny_family.draft(kind))
    H, V, inter = config["hidden_size"], config["vocab_size"], config["intermediate_size"]
    nh, nkv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    bf16 = {
        "embed_tokens.weight": (V, H),
        "hidden_norm.weight": (H,),
        "norm.weight": (H,),
    }
    fp4 = {"fc": (H, 6 * H)}  # logical [out, in]
    for i in range(6):
        p = f"layers.{i}"
        bf16.update(
            {
                f"{p}.input_layernorm.weight": (H,),
                f"{p}.post_attention_layernorm.weight": (H,),
                f"{p}.self_attn.q_proj.weight": (nh * hd, H),
                f"{p}.self_attn.k_proj.weight": (nkv * hd, H),
                f"{p}.self_attn.v_proj.weight": (nkv * hd, H),
                f"{p}.self_attn.o_proj.weight": (H, nh * hd),
                f"{p}.self_attn.q_norm.weight": (hd,),
                f"{p}.self_attn.k_norm.weight": (hd,),
            }
        )
        fp4.update(
            {
                f"{p}.mlp.gate_proj": (inter, H),
                f"{p}.mlp.up_proj": (inter, H),
                f"{p}.mlp.down_proj": (H, inter),
            }
        )
        if kind == "dspark":
            bf16[f"{p}.self_attn.attention_sink_bias"] = (nh,)
    if kind == "dspark":
        R = config["markov_rank"]
        bf16["markov_head.markov_w1.weight"] = (V, R)
        fp4["markov_head.markov_w2"] = (V, R)
    assert len(fp4) == 1 + 18 + (kind == "dspark")

    expected = {name: (torch.bfloat16, shape) for name, shape in bf16.items()}
    for module, (out_f, in_f) in fp4.items():
        expected[f"{module}.weight"] = (torch.uint8, (out_f, in_f // 2))
        expected[f"{module}.weight_scale"] = (torch.float8_e4m3fn, (out_f, in_f // 16))
        expected[f"{module}.weight_scale_2"] = (torch.float32, ())
    assert sorted(raw) == sorted(expected)
    assert not any(k.startswith("model.") for k in raw)
    for name, (dtype, shape) in expected.items():
        assert raw[name].dtype == dtype, f"{name}: dtype {raw[name].dtype}, expected {dtype}"
        assert tuple(raw[name].shape) == shape, (
            f"{name}: shape {tuple(raw[name].shape)}, expected {shape}"
        )
    # the helper that other code uses describes the same layout
    described = layout.checkpoint_layout(config)
    assert {k: (getattr(torch, d), s) for k, (d, s) in described.items()} == expected
    assert sorted(layout.nvfp4_modules(config)) == sorted(fp4)


@pytest.mark.parametrize("kind", KINDS)
def test_exclusions_match_packed_tensors(tiny_family, kind):
    """Every BF16 module matches a ModelOpt exclusion; no NVFP4 module does."""
    config = _config(tiny_family, kind)
    ignore = config["quantization_config"]["ignore"]
    raw = _raw_tensors(tiny_family.draft(kind))
    packed = {k[: -len(".weight_scale")] for k in raw if k.endswith(".weight_scale")}

    def excluded(module):
        return any(fnmatch.fnmatchcase(module, pat) for pat in ignore)

    for name, tensor in raw.items():
        module = name.rsplit(".", 1)[0]
        if module in packed:
            assert not excluded(module), f"NVFP4 module {module} matches an exclusion"
        else:
            assert tensor.dtype == torch.bfloat16
            assert excluded(module) or excluded(name), f"BF16 tensor {name} matches no exclusion"


@pytest.mark.parametrize("kind", KINDS)
def test_embed_tokens_is_a_copy_of_the_target_embedding(tiny_family, kind):
    raw = _raw_tensors(tiny_family.draft(kind))
    target = drafts.target_embedding(tiny_family.target)
    assert torch.equal(raw["embed_tokens.weight"], target.to(torch.bfloat16))


@pytest.mark.parametrize("kind", KINDS)
def test_nvfp4_scales_are_sane(tiny_family, kind):
    raw = _raw_tensors(tiny_family.draft(kind))
    scales2 = {k: float(v) for k, v in raw.items() if k.endswith("weight_scale_2")}
    assert all(s > 0 for s in scales2.values())
    # one global scale per module: gate and up of a layer generally differ (the fused-GEMM pitfall)
    assert (
        scales2["layers.0.mlp.gate_proj.weight_scale_2"]
        != scales2["layers.0.mlp.up_proj.weight_scale_2"]
    )


@pytest.mark.parametrize("kind", KINDS)
def test_read_draft_state_dict_of_family(tiny_family, kind):
    config = _config(tiny_family, kind)
    state = drafts.read_draft_state_dict(tiny_family.draft(kind))
    shapes = layout.logical_shapes(config)
    assert sorted(state) == sorted(shapes)
    for name, tensor in state.items():
        assert tensor.dtype == torch.float32
        assert tuple(tensor.shape) == shapes[name]
    raw = _raw_tensors(tiny_family.draft(kind))
    expected_fc = nvfp4.dequantize(
        raw["fc.weight"], raw["fc.weight_scale"], raw["fc.weight_scale_2"]
    )
    assert torch.equal(state["fc.weight"], expected_fc)
    assert torch.equal(state["norm.weight"], raw["norm.weight"].float())


@pytest.mark.parametrize("kind", KINDS)
def test_write_read_round_trip(tiny_family, tmp_path, kind):
    config = _config(tiny_family, kind)
    dense = drafts.init_draft_state_dict(config, seed=5)
    dense["fc.weight"] = dense["fc.weight"] * 7.0  # scales other than the init's
    out = drafts.write_draft(tmp_path / kind, kind, dense, tiny_family.target)
    assert json.loads((out / "config.json").read_text()) == config
    back = drafts.read_draft_state_dict(out)
    raw = _raw_tensors(out)
    assert sorted(back) == sorted(dense)
    packed = set(layout.nvfp4_modules(config))
    # packed with the reference quantizer (checked on a few modules; the rest via the raw tensors)
    for module in ("fc", "layers.0.mlp.gate_proj", "layers.5.mlp.down_proj") + (
        ("markov_head.markov_w2",) if kind == "dspark" else ()
    ):
        ref = nvfp4.quantize(dense[f"{module}.weight"])
        assert torch.equal(raw[f"{module}.weight"], ref.weight)
        assert torch.equal(
            raw[f"{module}.weight_scale"].view(torch.uint8), ref.weight_scale.view(torch.uint8)
        )
        assert torch.equal(raw[f"{module}.weight_scale_2"], ref.weight_scale_2)
    for name, value in dense.items():
        module = name[: -len(".weight")]
        if module in packed:
            expected = nvfp4.dequantize(
                raw[f"{module}.weight"],
                raw[f"{module}.weight_scale"],
                raw[f"{module}.weight_scale_2"],
            )
            # NVFP4 is lossy but close: a 4-bit code times an fp8 block scale
            assert (back[name] - value).abs().max() <= 0.35 * value.abs().max(), name
        else:
            expected = value.to(torch.bfloat16).float()
        assert torch.equal(back[name], expected), name


def test_write_draft_without_embed_copies_the_target(tiny_family, tmp_path):
    config = _config(tiny_family, "dflash")
    dense = drafts.init_draft_state_dict(config, seed=1)
    del dense["embed_tokens.weight"]
    out = drafts.write_draft(tmp_path / "d", "dflash", dense, tiny_family.target)
    back = drafts.read_draft_state_dict(out)
    assert torch.equal(
        back["embed_tokens.weight"], drafts.target_embedding(tiny_family.target).bfloat16().float()
    )


def test_write_draft_errors_name_the_tensor(tiny_family, tmp_path):
    config = _config(tiny_family, "dspark")
    dense = drafts.init_draft_state_dict(config, seed=1)
    bad = dict(dense)
    del bad["markov_head.markov_w1.weight"]
    with pytest.raises(KeyError, match="markov_head.markov_w1.weight"):
        drafts.write_draft(tmp_path / "a", "dspark", bad, tiny_family.target)
    bad = dict(dense)
    bad["layers.2.mlp.up_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(
        ValueError, match=r"layers\.2\.mlp\.up_proj\.weight.*\(384, 128\).*\(3, 3\)"
    ):
        drafts.write_draft(tmp_path / "b", "dspark", bad, tiny_family.target)
    bad = dict(dense)
    bad["layers.0.self_attn.attention_sink_bias"] = torch.full((8,), float("nan"))
    with pytest.raises(ValueError, match="attention_sink_bias"):
        drafts.write_draft(tmp_path / "c", "dspark", bad, tiny_family.target)
    with pytest.raises(ValueError, match="draft kind"):
        drafts.write_draft(tmp_path / "d", "eagle", dense, tiny_family.target)


def test_read_ignores_input_scale(tiny_family, tmp_path):
    raw = _raw_tensors(tiny_family.dflash_draft)
    raw["fc.input_scale"] = torch.tensor(0.5)
    save_file(raw, str(tmp_path / "model.safetensors"))
    with_scale = drafts.read_draft_state_dict(tmp_path)
    plain = drafts.read_draft_state_dict(tiny_family.dflash_draft)
    assert sorted(with_scale) == sorted(plain)
    assert all(torch.equal(with_scale[k], plain[k]) for k in plain)


def test_spread_layer_ids():
    assert drafts.spread_layer_ids(12) == [1, 3, 5, 7, 9, 11]
    assert drafts.spread_layer_ids(52) == [1, 11, 21, 31, 41, 51]
    with pytest.raises(ValueError, match="at least 7"):
        drafts.spread_layer_ids(5)
