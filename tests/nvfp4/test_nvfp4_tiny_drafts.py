"""The tiny drafts' quantization configs (vllm_nemotron_spec.tiny.drafts) against this config: every
linear the tiny checkpoint stores as NVFP4 gets the NVFP4 method, every other linear stays BF16,
under the module paths vLLM builds."""

from __future__ import annotations

import pytest

from vllm_nemotron_spec.checkpoint import layout
from vllm_nemotron_spec.nvfp4 import config as nvcfg
from vllm_nemotron_spec.tiny import drafts


def _draft_config(kind: str) -> dict:
    params = drafts.DraftParams()
    ids = drafts.spread_layer_ids(16, params.num_aux_layers)
    return drafts.draft_config(
        kind, hidden_size=64, vocab_size=256, target_layer_ids=ids, params=params
    )


def _linear_modules(config: dict) -> list[str]:
    """Checkpoint modules that vLLM builds as linear layers (not embeddings, norms or sinks)."""
    modules = []
    for name, shape in layout.logical_shapes(config).items():
        module = name.removesuffix(".weight")
        if (
            name.endswith(".weight")
            and len(shape) == 2
            and module.split(".")[-1]
            not in (
                "embed_tokens",
                "markov_w1",  # an nn.Embedding in vLLM's DSpark head
            )
        ):
            modules.append(module)
    return modules


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_tiny_draft_exclusions_select_exactly_its_nvfp4_linears(kind):
    config = _draft_config(kind)
    quant = config["quantization_config"]
    override = nvcfg.NemotronW4A16NvFp4Config.override_quantization_method
    assert override(quant, None) == nvcfg.NAME
    assert override(layout.hf_quant_config(kind), None) == nvcfg.NAME
    for qc in (
        nvcfg.NemotronW4A16NvFp4Config.from_config(quant),
        nvcfg.NemotronW4A16NvFp4Config.from_config(layout.hf_quant_config(kind)),
    ):
        qc.packed_modules_mapping = {
            "qkv_proj": ["q_proj", "k_proj", "v_proj"],
            "gate_up_proj": ["gate_proj", "up_proj"],
        }
        modules = _linear_modules(config)
        assert "fc" in modules and "layers.0.mlp.down_proj" in modules
        fused = ["layers.0.self_attn.qkv_proj", "layers.0.mlp.gate_up_proj"]
        for module in modules + fused:
            quantized = module in fused[1:] or layout.is_nvfp4_module(module)
            for path in (module, f"model.{module}", f"draft_model.model.{module}"):
                assert qc.is_layer_excluded(path) is not quantized, path
