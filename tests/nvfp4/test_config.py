"""The registered quantization config: which checkpoints it claims (through vLLM's own ModelConfig
resolution), registration, parsing, and the per-platform choice of linear method."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from vllm_nemotron_spec.nvfp4 import config as nvcfg

W4A16_FLAT = {
    "quant_method": "modelopt",
    "quant_algo": "W4A16_NVFP4",
    "group_size": 16,
    "ignore": ["lm_head", "model.embed_tokens", "model.layers.*.self_attn*"],
    "producer": {"name": "modelopt", "version": "0.47.0"},
}
W4A16_NESTED = {  # hf_quant_config.json
    "producer": {"name": "modelopt", "version": "0.29.0"},
    "quantization": {
        "quant_algo": "W4A16_NVFP4",
        "group_size": 16,
        "kv_cache_quant_algo": None,
        "exclude_modules": ["lm_head", "model.embed_tokens"],
    },
}
FP8_FLAT = {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["lm_head"]}
NVFP4_W4A4_FLAT = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}


@pytest.fixture(scope="module")
def registered():
    return nvcfg.register()


@pytest.mark.parametrize(
    "hf_quant_cfg",
    [
        W4A16_FLAT,
        {**W4A16_FLAT, "quant_algo": "w4a16_nvfp4"},  # ModelOpt may write it lower-case
        {k: v for k, v in W4A16_FLAT.items() if k != "producer"},
        W4A16_NESTED,
        {**W4A16_NESTED, "quant_method": "modelopt"},  # the nested form after vLLM's normalisation
        {"quant_method": "modelopt_fp4", "quant_algo": "W4A16_NVFP4"},
    ],
)
def test_claims_modelopt_w4a16_nvfp4_checkpoints(hf_quant_cfg):
    override = nvcfg.NemotronW4A16NvFp4Config.override_quantization_method
    assert override(hf_quant_cfg, None) == nvcfg.NAME
    assert override(hf_quant_cfg, nvcfg.NAME) == nvcfg.NAME


@pytest.mark.parametrize(
    "hf_quant_cfg",
    [
        FP8_FLAT,
        NVFP4_W4A4_FLAT,
        {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION"},
        {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8"}},
        {"quant_method": "compressed-tensors", "quant_algo": "W4A16_NVFP4"},
        {"quant_method": "gptq", "bits": 4},
        {"quant_method": "modelopt"},
        {},
        None,
    ],
)
def test_leaves_every_other_checkpoint_to_vllm(hf_quant_cfg):
    assert nvcfg.NemotronW4A16NvFp4Config.override_quantization_method(hf_quant_cfg, None) is None


def test_an_explicit_choice_of_another_method_wins():
    override = nvcfg.NemotronW4A16NvFp4Config.override_quantization_method
    assert override(W4A16_FLAT, "modelopt_fp4") is None
    with pytest.raises(ValueError, match=r"quant_algo 'W4A16_NVFP4'.*quant_algo 'FP8'"):
        override(FP8_FLAT, nvcfg.NAME)


def test_register_is_idempotent(registered):
    from vllm.model_executor.layers import quantization as vllm_quant
    from vllm.model_executor.layers.linear import WEIGHT_LOADER_V2_SUPPORTED

    assert registered == [f"quantization {nvcfg.NAME} (ModelOpt W4A16_NVFP4)"]
    assert nvcfg.register() == registered
    assert vllm_quant.QUANTIZATION_METHODS.count(nvcfg.NAME) == 1
    assert vllm_quant.get_quantization_config(nvcfg.NAME) is nvcfg.NemotronW4A16NvFp4Config
    for cls in (nvcfg.NvFp4DequantizedLinearMethod, nvcfg.NvFp4KernelLinearMethod):
        assert WEIGHT_LOADER_V2_SUPPORTED.count(cls.__name__) == 1


def test_from_config_reads_both_forms():
    flat = nvcfg.NemotronW4A16NvFp4Config.from_config(W4A16_FLAT)
    assert flat.get_name() == nvcfg.NAME
    assert flat.quant_method == "W4A16_NVFP4" and flat.group_size == 16
    assert flat.exclude_modules == W4A16_FLAT["ignore"]
    nested = nvcfg.NemotronW4A16NvFp4Config.from_config(W4A16_NESTED)
    assert nested.exclude_modules == ["lm_head", "model.embed_tokens"]
    assert torch.float32 in flat.get_supported_act_dtypes()  # CPU: any float dtype is exact


def test_from_config_rejects_what_it_cannot_load():
    with pytest.raises(ValueError, match=r"quant_algo 'W4A16_NVFP4'.*'NVFP4'"):
        nvcfg.NemotronW4A16NvFp4Config.from_config(NVFP4_W4A4_FLAT)
    with pytest.raises(ValueError, match="group_size 16.*got 32"):
        nvcfg.NemotronW4A16NvFp4Config.from_config({**W4A16_FLAT, "group_size": 32})


def test_linear_method_follows_the_platform():
    cpu = SimpleNamespace(is_cpu=lambda: True)
    cuda = SimpleNamespace(is_cpu=lambda: False)
    assert nvcfg.linear_method_class(cpu) is nvcfg.NvFp4DequantizedLinearMethod
    assert nvcfg.linear_method_class(cuda) is nvcfg.NvFp4KernelLinearMethod


def _model_dir(tmp_path, name, quantization_config):
    path = tmp_path / name
    path.mkdir()
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "max_position_embeddings": 256,
        "torch_dtype": "float32",
    }
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize(
    "name, quantization_config, user_choice, expected",
    [
        ("w4a16", W4A16_FLAT, None, nvcfg.NAME),
        ("fp8", FP8_FLAT, None, "modelopt"),
        ("nvfp4_w4a4", NVFP4_W4A4_FLAT, None, "modelopt_fp4"),
        ("unquantized", None, None, None),
        ("w4a16_user_modelopt_fp4", W4A16_FLAT, "modelopt_fp4", "modelopt_fp4"),
    ],
)
def test_vllm_model_config_resolution(
    registered, tmp_path, name, quantization_config, user_choice, expected
):
    """Through vLLM's own ModelConfig._verify_quantization: only W4A16 NVFP4 changes."""
    from vllm.config import ModelConfig

    model = _model_dir(tmp_path, name, quantization_config)
    config = ModelConfig(
        model=model, skip_tokenizer_init=True, quantization=user_choice, dtype="float32"
    )
    assert config.quantization == expected
