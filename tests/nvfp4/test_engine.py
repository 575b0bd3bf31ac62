"""A tiny W4A16 NVFP4 checkpoint in the real vLLM engine on CPU: detected without flags, and it
computes what its dequantized twin computes, as a model and as a speculative draft."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from vllm_nemotron_spec import runs
from vllm_nemotron_spec.nvfp4 import config as nvcfg
from vllm_nemotron_spec.nvfp4 import format as nvfp4

pytestmark = pytest.mark.engine

CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
QUANTIZATION_CONFIG = {  # the flat form ModelOpt writes into config.json
    "quant_method": "modelopt",
    "quant_algo": "W4A16_NVFP4",
    "group_size": 16,
    "ignore": ["lm_head", "model.embed_tokens", "model.layers.*.self_attn*"],
    "producer": {"name": "modelopt", "version": "0.47.0"},
}
PROMPTS = [[5, 17, 99, 3, 42, 7], [200, 13, 13, 64]]


def _dense_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, inter, vocab = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["vocab_size"]
    q_out = CONFIG["num_attention_heads"] * CONFIG["head_dim"]
    kv_out = CONFIG["num_key_value_heads"] * CONFIG["head_dim"]

    def randn(*shape, std):
        return torch.randn(*shape, generator=g) * std

    t = {"model.embed_tokens.weight": randn(vocab, h, std=1.0), "model.norm.weight": torch.ones(h)}
    t["lm_head.weight"] = randn(vocab, h, std=0.3)
    for i in range(CONFIG["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = torch.ones(h)
        t[p + "post_attention_layernorm.weight"] = torch.ones(h)
        t[p + "self_attn.q_proj.weight"] = randn(q_out, h, std=0.2)
        t[p + "self_attn.k_proj.weight"] = randn(kv_out, h, std=0.2)
        t[p + "self_attn.v_proj.weight"] = randn(kv_out, h, std=0.2)
        t[p + "self_attn.o_proj.weight"] = randn(h, q_out, std=0.2)
        t[p + "self_attn.q_norm.weight"] = torch.ones(CONFIG["head_dim"])
        t[p + "self_attn.k_norm.weight"] = torch.ones(CONFIG["head_dim"])
        # gate and up with different amax -> different weight_scale_2 per shard
        t[p + "mlp.gate_proj.weight"] = randn(inter, h, std=0.15)
        t[p + "mlp.up_proj.weight"] = randn(inter, h, std=0.6)
        t[p + "mlp.down_proj.weight"] = randn(h, inter, std=0.2)
    return t


def _write(path: Path, tensors: dict[str, torch.Tensor], quantization_config=None) -> str:
    path.mkdir(parents=True)
    config = dict(CONFIG)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return str(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(NVFP4 checkpoint, its dequantized fp32 twin): the MLP linears quantized, the rest shared."""
    root = tmp_path_factory.mktemp("nvfp4_engine")
    dense = _dense_tensors()
    quantized, twin = {}, {}
    for name, tensor in dense.items():
        if ".mlp." in name:
            module = name.removesuffix(".weight")
            q = nvfp4.quantize(tensor)
            quantized.update(q.tensors(module))
            quantized[f"{module}.input_scale"] = torch.tensor(1.0)  # ModelOpt may write one
            twin[name] = q.dequantize(torch.float32)
        else:
            quantized[name] = twin[name] = tensor
    gate = quantized["model.layers.0.mlp.gate_proj.weight_scale_2"]
    up = quantized["model.layers.0.mlp.up_proj.weight_scale_2"]
    assert float(gate) != float(up)
    return _write(root / "nvfp4", quantized, QUANTIZATION_CONFIG), _write(root / "twin", twin)


def _generate(llm, max_tokens=12):
    from vllm import SamplingParams

    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _llm(model, **kwargs):
    from vllm import LLM

    return LLM(
        model=model,
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        max_num_seqs=4,
        seed=0,
        **kwargs,
    )


def _spec_counts(llm) -> tuple[int, int]:
    metrics = {m.name: m for m in llm.get_metrics()}
    return (
        int(metrics["vllm:spec_decode_num_draft_tokens"].value),
        int(metrics["vllm:spec_decode_num_accepted_tokens"].value),
    )


def test_nvfp4_model_and_draft_run_on_vllm_cpu(checkpoints):
    nvcfg.register()
    quantized, twin = checkpoints

    llm = _llm(twin)
    try:
        expected = _generate(llm)
    finally:
        runs.release(llm)

    llm = _llm(quantized)
    try:
        assert llm.llm_engine.model_config.quantization == nvcfg.NAME
        assert _generate(llm) == expected
    finally:
        runs.release(llm)

    # The NVFP4 checkpoint as the draft of its own dequantized twin: lossless, and the draft
    # agrees with the target (same weights), so nearly every drafted token is accepted.
    llm = _llm(
        twin,
        speculative_config={
            "method": "draft_model",
            "model": quantized,
            "num_speculative_tokens": 3,
        },
        disable_log_stats=False,
    )
    try:
        spec = llm.llm_engine.vllm_config.speculative_config
        assert spec.draft_model_config.quantization == nvcfg.NAME
        assert llm.llm_engine.model_config.quantization is None
        assert _generate(llm) == expected
        drafted, accepted = _spec_counts(llm)
    finally:
        runs.release(llm)
    assert drafted > 0 and accepted >= 0.9 * drafted
