"""benchmarks/harness/models.py and safetensors_io.py: the Lightning checkpoints the benchmarks
write, checked at tiny widths against what reads them (transformers' NemotronH names and shapes,
vLLM's ModelOpt mixed-precision config, the draft layout, safetensors), the values they hold, and
the synthetic acceptance schedule."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from benchmarks.harness import models
from benchmarks.harness import safetensors_io as st


def _read_all(directory):
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    out = {}
    for name in sorted(set(index["weight_map"].values())):
        with safe_open(str(directory / name), "pt") as f:
            for key in f.keys():
                out[key] = f.get_tensor(key)
    assert set(out) == set(index["weight_map"])
    return out


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    directory = tmp_path_factory.mktemp("target")
    config = models.build_target(directory, models.TINY_SHAPE, True, models.Pools(scale=64))
    return directory, config, _read_all(directory)


def _transformers_names(directory):
    """Checkpoint names and logical shapes of transformers' NemotronH for the config.json in
    ``directory`` (built on the meta device; its fused experts as the per-expert tensors a
    checkpoint stores)."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    cfg = NemotronHConfig.from_pretrained(str(directory))
    with torch.device("meta"):
        model = NemotronHForCausalLM(cfg)
    out = {}
    for name, t in model.state_dict().items():
        name = "backbone." + name[len("model.") :] if name.startswith("model.") else name
        if name.endswith(("experts.up_proj", "experts.down_proj")):
            for e in range(t.shape[0]):
                out[name.replace("experts.", f"experts.{e}.") + ".weight"] = tuple(t.shape[1:])
        else:
            out[name] = tuple(t.shape)
    return out


def test_target_has_every_tensor_transformers_names_at_its_logical_shape(tiny_target):
    directory, _, tensors = tiny_target
    expected = _transformers_names(directory)
    stored = {}
    for name, t in tensors.items():
        if name.endswith((".weight_scale", ".weight_scale_2", ".input_scale")):
            continue
        shape = tuple(t.shape)
        if t.dtype == torch.uint8:  # packed NVFP4: two values a byte
            shape = (shape[0], shape[1] * 2)
        stored[name] = shape
    assert stored == expected


def test_quantized_modules_and_their_tensors(tiny_target):
    _, config, tensors = tiny_target
    layers = config["quantization_config"]["quantized_layers"]
    shape = models.TINY_SHAPE
    assert len(layers) == shape.pattern.count("E") * (2 * shape.n_routed_experts + 2) + 2 * (
        shape.pattern.count("M")
    )
    for module, recipe in layers.items():
        if recipe["quant_algo"] == "W4A16_NVFP4":
            w, scale = tensors[f"{module}.weight"], tensors[f"{module}.weight_scale"]
            assert w.dtype == torch.uint8 and scale.dtype == torch.float8_e4m3fn
            assert scale.shape == (w.shape[0], w.shape[1] * 2 // 16)
            assert float(scale.float().min()) >= 1.0 and float(scale.float().max()) <= 2.0
            assert float(tensors[f"{module}.weight_scale_2"]) > 0
        else:
            assert recipe["quant_algo"] == "FP8"
            assert tensors[f"{module}.weight"].dtype == torch.float8_e4m3fn
            assert torch.isfinite(tensors[f"{module}.weight"].float()).all()
            assert float(tensors[f"{module}.weight_scale"]) > 0
            assert float(tensors[f"{module}.input_scale"]) > 0
    for name, t in tensors.items():
        if name.endswith("e_score_correction_bias"):
            assert not t.any()
        if t.dtype == torch.bfloat16 and "norm" not in name:
            assert torch.isfinite(t.float()).all() and 0.01 < float(t.float().std()) < 0.04


def test_nvfp4_values_dequantize_to_finite_weights_of_the_intended_scale(tiny_target):
    from vllm_nemotron_spec.nvfp4.format import dequantize

    _, _, tensors = tiny_target
    p = "backbone.layers.1.mixer.experts.3.up_proj"
    w = dequantize(tensors[f"{p}.weight"], tensors[f"{p}.weight_scale"],
                   tensors[f"{p}.weight_scale_2"])  # fmt: skip
    assert torch.isfinite(w).all() and 0.01 < float(w.std()) < 0.04
    other = "backbone.layers.1.mixer.experts.4.up_proj.weight"
    assert not torch.equal(tensors[f"{p}.weight"], tensors[other])  # experts differ


def test_vllm_reads_the_config_as_modelopt_mixed_with_the_intended_algorithms(tiny_target):
    from vllm.model_executor.layers.quantization import modelopt
    from vllm.model_executor.models.nemotron_h import NemotronHForCausalLM

    from vllm_nemotron_spec.nvfp4.config import NemotronW4A16NvFp4Config

    qcfg = tiny_target[1]["quantization_config"]
    assert modelopt.ModelOptMixedPrecisionConfig.override_quantization_method(qcfg, None) == (
        "modelopt_mixed"
    )
    for other in (modelopt.ModelOptFp8Config, modelopt.ModelOptNvFp4Config,
                  NemotronW4A16NvFp4Config):  # fmt: skip
        assert other.override_quantization_method(qcfg, None) is None
    qc = modelopt.ModelOptMixedPrecisionConfig.from_config(qcfg)
    qc.packed_modules_mapping = NemotronHForCausalLM.packed_modules_mapping
    qc.apply_vllm_mapper(NemotronHForCausalLM.hf_to_vllm_mapper)
    assert qc._resolve_quant_algo("model.layers.1.mixer.experts") == "W4A16_NVFP4"
    assert qc._resolve_quant_algo("model.layers.1.mixer.shared_experts.up_proj") == "W4A16_NVFP4"
    assert qc._resolve_quant_algo("model.layers.0.mixer.in_proj") == "FP8"
    assert qc._resolve_quant_algo("model.layers.2.mixer.out_proj") == "FP8"
    assert qc._resolve_quant_algo("model.layers.3.mixer.qkv_proj") is None  # BF16
    assert qc._resolve_quant_algo("model.layers.3.mixer.o_proj") is None
    assert qc._resolve_quant_algo("lm_head") is None


def test_a_rebuild_is_skipped_while_the_stamp_matches(tiny_target, capsys):
    directory, config, _ = tiny_target
    assert models.build_target(directory, models.TINY_SHAPE, True) == config
    assert "reusing the target" in capsys.readouterr().out


def test_the_target_carries_a_tokenizer_of_its_whole_vocabulary(tiny_target):
    """What starts an engine with a tokenizer (``tune``) starts on the benchmark target: every id
    the random weights can produce decodes, and the special ids are the config's."""
    from transformers import AutoTokenizer

    directory, config, _ = tiny_target
    tok = AutoTokenizer.from_pretrained(str(directory))
    assert len(tok) == config["vocab_size"]
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (
        config["pad_token_id"], config["bos_token_id"], config["eos_token_id"],
    )  # fmt: skip
    last = config["vocab_size"] - 1
    assert tok.decode([3, last]) == f"w3 w{last}"
    assert tok.encode("w7 unknown", add_special_tokens=False) == [7, config["pad_token_id"]]
    (directory / "tokenizer.json").unlink()  # an older build without one gains it on reuse
    models.build_target(directory, models.TINY_SHAPE, True)
    assert len(AutoTokenizer.from_pretrained(str(directory))) == config["vocab_size"]


def test_drafts_follow_the_official_layout():
    from vllm_nemotron_spec.checkpoint import layout
    from vllm_nemotron_spec.tiny import drafts

    for kind in layout.KINDS:
        config = drafts.draft_config(kind, hidden_size=128, vocab_size=1024,
                                     target_layer_ids=[1, 2, 3, 4, 5, 6])  # fmt: skip
        entries = models.draft_entries(config, models.Pools(scale=256))
        dtypes = {"U8": "uint8", "F8_E4M3": "float8_e4m3fn", "F32": "float32", "BF16": "bfloat16"}
        assert {e.name: (dtypes[e.dtype], tuple(e.shape)) for e in entries} == (
            layout.checkpoint_layout(config)
        )


class _Gate(torch.nn.Module):
    def __init__(self, weight, bias):
        super().__init__()
        self.weight = torch.nn.Parameter(weight)
        self.e_score_correction_bias = torch.nn.Parameter(bias)


class _MoeLayer(torch.nn.Module):
    """NemotronH's MoE decoder layer, as far as the routing check reads it."""

    def __init__(self, weight, bias, norm):
        super().__init__()
        self.norm = torch.nn.Module()
        self.norm.weight = torch.nn.Parameter(norm)
        self.mixer = torch.nn.Module()
        self.mixer.gate = _Gate(weight, bias)
        self.mixer.experts = torch.nn.Module()
        self.mixer.experts.top_k = 6


class _Model(torch.nn.Module):
    def __init__(self, embed, weight, bias, norm=None):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding.from_pretrained(embed)
        norm = torch.ones(embed.shape[1]) if norm is None else norm
        self.model.layers = torch.nn.ModuleList([torch.nn.Module(), _MoeLayer(weight, bias, norm)])


def test_routing_spread_counts_the_experts_tokens_reach():
    """The engine's routing check: a router whose logits follow the tokens spreads them over the
    experts; one whose constant bias dominates sends every token to the same top-k."""
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(1000, 256, generator=g) * 0.02
    ours = _Model(embed, torch.randn(128, 256, generator=g) * 0.02, torch.zeros(128))
    spread = models.routing_spread(ours)
    assert spread["uniform_expectation"] > 120
    assert spread["experts_touched"] >= 0.8 * spread["uniform_expectation"]
    # logits the same for every token (a zero router): the bias alone decides
    flat = _Model(embed, torch.zeros(128, 256), torch.rand(128, generator=g) * 1e-3)
    assert models.routing_spread(flat)["experts_touched"] == 6


@pytest.mark.parametrize("method, length, n", [("dflash", 3.18, 5), ("dspark", 3.69, 7)])
def test_acceptance_rates_reproduce_nvidias_lengths(method, length, n):
    rates, alpha, expected = models.acceptance_rates(method, n)
    assert expected == pytest.approx(length, abs=1e-9)
    assert rates == pytest.approx([alpha**i for i in range(1, n + 1)])
    assert all(a >= b for a, b in zip(rates, rates[1:]))


def test_dspark3_keeps_the_seven_draft_rate():
    r3, a3, l3 = models.acceptance_rates("dspark", 3)
    _, a7, _ = models.acceptance_rates("dspark", 7)
    assert a3 == a7 == pytest.approx(0.7588, abs=1e-4)
    assert l3 == pytest.approx(1 + a7 + a7**2 + a7**3)
    with pytest.raises(ValueError, match="impossible with 2 drafts"):
        models.geometric_alpha(3.5, 2)


def test_safetensors_writer_round_trips_and_refuses_bad_entries(tmp_path):
    pool = st.bf16_normal_pool(1 << 12, 0.5, seed=0)
    entries = [
        st.Entry("a", "BF16", (16, 8), pool=pool),
        st.Entry("b", "F32", (3,), st.constant(2.5, "F32", 3)),
        st.Entry("c", "BF16", (2,), st.constant(1.0, "BF16", 2)),
        st.Entry("d", "U8", (5000,), pool=st.uniform_byte_pool(64, 3, 4, seed=1)),  # wraps
    ]
    st.write_safetensors(tmp_path / "x.safetensors", entries)
    with safe_open(str(tmp_path / "x.safetensors"), "pt") as f:
        assert f.get_tensor("b").tolist() == [2.5] * 3
        assert f.get_tensor("c").tolist() == [1.0, 1.0]
        a = f.get_tensor("a")
        assert a.dtype == torch.bfloat16 and a.shape == (16, 8) and 0.2 < float(a.std()) < 1.0
        assert set(f.get_tensor("d").unique().tolist()) <= {3, 4}
    with pytest.raises(ValueError, match="needs 8"):
        st.write_safetensors(tmp_path / "y.safetensors", [st.Entry("e", "F32", (2,), b"x")])
    with pytest.raises(ValueError, match="unknown safetensors dtypes"):
        st.write_safetensors(tmp_path / "z.safetensors", [st.Entry("e", "Q4", (2,), b"xx")])
