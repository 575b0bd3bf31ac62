"""NVFP4 linear layers built from vLLM's own layer classes on CPU (tp=1): loading through the
weight loaders, exact outputs, exclusions, checkpoint shape errors, and the GPU method's handling
of fused shards with different global scales (with a stand-in for vLLM's kernel)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_nemotron_spec.nvfp4 import config as nvcfg
from vllm_nemotron_spec.nvfp4 import format as nvfp4

CONFIG = {"quant_method": "modelopt", "quant_algo": "W4A16_NVFP4", "group_size": 16}
IGNORE = [
    "lm_head",
    "model.embed_tokens",
    "model.layers.*.self_attn*",
    "markov_head.markov_w1",
]


@pytest.fixture
def qc(vllm_ctx):
    return nvcfg.NemotronW4A16NvFp4Config.from_config({**CONFIG, "ignore": IGNORE})


def load_module(layer: torch.nn.Module, tensors: dict[str, torch.Tensor], shard_id=None) -> None:
    """Load one checkpoint module's tensors through the parameters' weight loaders, as a vLLM
    model's load_weights does (with a shard id for fused layers)."""
    for name, tensor in tensors.items():
        param = getattr(layer, name)
        args = () if shard_id is None else (shard_id,)
        param.weight_loader(param, tensor, *args)


def _weight(out_features, in_features, seed, global_scale=None, std=0.05):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g) * std
    return nvfp4.quantize(w, global_scale=global_scale)


def _tensors(q: nvfp4.NVFP4Weight, input_scale: bool = False) -> dict[str, torch.Tensor]:
    out = {"weight": q.weight, "weight_scale": q.weight_scale, "weight_scale_2": q.weight_scale_2}
    if input_scale:
        out["input_scale"] = torch.tensor(0.5)
    return out


def _x(m, k, seed=7, dtype=torch.float32):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _replicated(qc, in_features, out_features, dtype=torch.float32, prefix="model.fc"):
    from vllm.model_executor.layers.linear import ReplicatedLinear

    return ReplicatedLinear(
        in_features, out_features, bias=False, quant_config=qc, prefix=prefix, params_dtype=dtype
    )


def _gate_up(qc, hidden, inter, dtype=torch.float32):
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    return MergedColumnParallelLinear(
        hidden, [inter, inter], bias=False, quant_config=qc,
        prefix="model.layers.0.mlp.gate_up_proj", params_dtype=dtype,
    )  # fmt: skip


def _four_x_shards(hidden=64, inter=48):
    """gate and up where up's weight_scale_2 is exactly 4x gate's (gate's weights 4x smaller)."""
    up = _weight(inter, hidden, seed=2)
    gate = _weight(inter, hidden, seed=3, std=0.05 / 4, global_scale=float(up.weight_scale_2) / 4)
    assert float(up.weight_scale_2) == 4 * float(gate.weight_scale_2)
    return gate, up


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fc_is_bit_exact_with_the_reference(qc, dtype):
    layer = _replicated(qc, 256, 48, dtype)
    assert type(layer.quant_method) is nvcfg.NvFp4DequantizedLinearMethod
    q = _weight(48, 256, seed=1)
    load_module(layer, _tensors(q, input_scale=True))
    layer.quant_method.process_weights_after_loading(layer)
    assert {n for n, _ in layer.named_parameters()} == {"weight"}
    assert layer.weight.dtype == dtype and layer.weight.shape == (48, 256)
    reference = q.dequantize(dtype)
    assert torch.equal(layer.weight, reference)
    for m in (1, 4, 16):
        x = _x(m, 256, dtype=dtype)
        assert torch.equal(layer(x)[0], x @ reference.T)


def test_gate_up_with_4x_different_global_scales_is_exact(qc):
    layer = _gate_up(qc, 64, 48)
    gate, up = _four_x_shards()
    load_module(layer, _tensors(gate, input_scale=True), shard_id=0)
    load_module(layer, _tensors(up, input_scale=True), shard_id=1)
    layer.quant_method.process_weights_after_loading(layer)
    reference = torch.cat([gate.dequantize(), up.dequantize()])
    assert torch.equal(layer.weight, reference)
    x = _x(5, 64)
    assert torch.equal(layer(x)[0], x @ reference.T)


def test_down_row_parallel_is_exact(qc):
    from vllm.model_executor.layers.linear import RowParallelLinear

    layer = RowParallelLinear(
        96, 64, bias=False, quant_config=qc, prefix="model.layers.0.mlp.down_proj",
        params_dtype=torch.float32,
    )  # fmt: skip
    q = _weight(64, 96, seed=4)
    load_module(layer, _tensors(q))
    layer.quant_method.process_weights_after_loading(layer)
    x = _x(3, 96)
    assert torch.equal(layer(x)[0], x @ q.dequantize().T)


def test_quantized_qkv_keeps_each_shards_global_scale(qc):
    from vllm.model_executor.layers.linear import QKVParallelLinear

    layer = QKVParallelLinear(
        64, 32, 2, 1, bias=False, quant_config=qc, prefix="model.layers.0.attn.qkv_proj",
        params_dtype=torch.float32,
    )  # fmt: skip
    assert type(layer.quant_method) is nvcfg.NvFp4DequantizedLinearMethod
    shards = {"q": _weight(64, 64, 5), "k": _weight(32, 64, 6, std=0.2), "v": _weight(32, 64, 7)}
    for shard_id, q in shards.items():
        load_module(layer, _tensors(q), shard_id=shard_id)
    layer.quant_method.process_weights_after_loading(layer)
    reference = torch.cat([q.dequantize() for q in shards.values()])
    x = _x(4, 64)
    assert torch.equal(layer(x)[0], x @ reference.T)


def test_markov_w2_lm_head_is_exact_and_pads_with_zeros(qc):
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    vocab, rank = 200, 64  # the padded vocabulary is 256
    layer = ParallelLMHead(
        vocab, rank, bias=False, quant_config=qc, prefix="markov_head.markov_w2", disable_tp=True,
        params_dtype=torch.float32,
    )  # fmt: skip
    assert type(layer.quant_method) is nvcfg.NvFp4DequantizedLinearMethod
    q = _weight(vocab, rank, seed=8)
    load_module(layer, _tensors(q))
    layer.quant_method.process_weights_after_loading(layer)
    x = _x(6, rank)
    out = layer.quant_method.apply(layer, x)
    assert out.shape == (6, layer.num_embeddings_padded)
    assert torch.equal(out[:, :vocab], x @ q.dequantize().T)
    assert out[:, vocab:].abs().sum() == 0


def test_excluded_modules_stay_unquantized(qc):
    from vllm.model_executor.layers.linear import (
        QKVParallelLinear,
        RowParallelLinear,
        UnquantizedLinearMethod,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    qkv = QKVParallelLinear(
        64, 32, 2, 1, bias=False, quant_config=qc, prefix="model.layers.3.self_attn.qkv_proj",
        params_dtype=torch.bfloat16,
    )  # fmt: skip
    o_proj = RowParallelLinear(
        64, 64, bias=False, quant_config=qc, prefix="model.layers.3.self_attn.o_proj",
        params_dtype=torch.bfloat16,
    )  # fmt: skip
    lm_head = ParallelLMHead(
        256, 64, quant_config=qc, prefix="lm_head", params_dtype=torch.bfloat16
    )
    for layer in (qkv, o_proj, lm_head):
        assert type(layer.quant_method) is UnquantizedLinearMethod
        assert layer.weight.dtype == torch.bfloat16
    embed = VocabParallelEmbedding(256, 64, quant_config=qc, prefix="model.embed_tokens")
    assert type(embed.quant_method).__name__ == "UnquantizedEmbeddingMethod"
    # markov_w1 in the exclusions does not catch markov_w2 (no prefix overlap).
    markov_w2 = ParallelLMHead(256, 64, quant_config=qc, prefix="markov_head.markov_w2")
    assert type(markov_w2.quant_method) is nvcfg.NvFp4DequantizedLinearMethod


@pytest.mark.parametrize(
    "prefix, excluded",
    [
        ("layers.0.self_attn.qkv_proj", True),
        ("model.layers.52.self_attn.qkv_proj", True),  # vLLM's DFlash numbering
        ("draft_model.model.layers.0.self_attn.o_proj", True),  # method="draft_model"
        ("model.layers.0.mlp.gate_up_proj", False),
        ("draft_model.model.layers.0.mlp.down_proj", False),
        ("model.fc", False),
        ("model.hidden_norm", True),
        ("markov_head.markov_w1", True),
        ("markov_head.markov_w2", False),
    ],
)
def test_checkpoint_patterns_match_under_vllm_module_prefixes(vllm_ctx, prefix, excluded):
    """The tiny / official drafts name modules from the draft's root ("layers.*.self_attn*")."""
    patterns = [
        "lm_head",
        "embed_tokens",
        "hidden_norm",
        "norm",
        "layers.*.input_layernorm",
        "layers.*.post_attention_layernorm",
        "layers.*.self_attn*",
        "markov_head.markov_w1",
    ]
    qc = nvcfg.NemotronW4A16NvFp4Config.from_config({**CONFIG, "ignore": patterns})
    assert qc.is_layer_excluded(prefix) is excluded


def test_exclusion_by_shard_names_applies_to_the_fused_layer(vllm_ctx):
    from vllm.model_executor.layers.linear import QKVParallelLinear, UnquantizedLinearMethod

    names = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    qc = nvcfg.NemotronW4A16NvFp4Config.from_config({**CONFIG, "ignore": names})
    qc.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    expectations = ((0, UnquantizedLinearMethod), (1, nvcfg.NvFp4DequantizedLinearMethod))
    for layer_id, expected in expectations:
        layer = QKVParallelLinear(
            64, 32, 2, 1, bias=False, quant_config=qc,
            prefix=f"model.layers.{layer_id}.self_attn.qkv_proj",
        )  # fmt: skip
        assert type(layer.quant_method) is expected


def test_a_wrongly_packed_fc_names_the_tensor_and_both_shapes(qc):
    layer = _replicated(qc, 16128, 2688)  # the real draft's fc
    with pytest.raises(ValueError) as err:
        load_module(layer, {"weight": torch.zeros(2688, 16128, dtype=torch.uint8)})
    message = str(err.value)
    assert message.startswith("model.fc.weight: found torch.uint8 [2688, 16128]")
    assert "torch.uint8 [2688, 8064]" in message and "logical [2688, 16128]" in message
    with pytest.raises(ValueError, match=r"bfloat16 weight means .* exclusions"):
        load_module(layer, {"weight": torch.zeros(2688, 16128, dtype=torch.bfloat16)})
    bad_scale = torch.zeros(2688, 2016, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"model\.fc\.weight_scale: .*\[2688, 1008\]"):
        load_module(layer, {"weight_scale": bad_scale})
    load_module(layer, {"weight": torch.zeros(2688, 8064, dtype=torch.uint8)})  # the right shape


def test_a_wrong_shard_names_the_shard(qc):
    layer = _gate_up(qc, 64, 48)
    with pytest.raises(ValueError) as err:
        load_module(layer, {"weight": torch.zeros(40, 32, dtype=torch.uint8)}, shard_id=1)
    message = str(err.value)
    assert "model.layers.0.mlp.gate_up_proj.weight (shard 1)" in message
    assert "[48, 32]" in message and "logical [48, 64]" in message


def test_unloaded_tensors_are_reported(qc):
    layer = _gate_up(qc, 64, 48)
    with pytest.raises(RuntimeError, match="gate_up_proj.weight_scale was never loaded"):
        layer.quant_method.process_weights_after_loading(layer)
    gate = _weight(48, 64, 1)
    load_module(layer, _tensors(gate), shard_id=0)
    load_module(layer, {"weight": gate.weight, "weight_scale": gate.weight_scale}, shard_id=1)
    with pytest.raises(RuntimeError, match=r"weight_scale_2 was never loaded for shard\(s\) \[1\]"):
        layer.quant_method.process_weights_after_loading(layer)


# --- the GPU method, with a stand-in for vLLM's kernel -------------------------------------------


class FakeKernel:
    """Computes what a W4A16 kernel computes from the tensors it is given: ONE global scale."""

    made: list[FakeKernel] = []

    def __init__(self):
        FakeKernel.made.append(self)

    def process_weights_after_loading(self, layer):
        self.dense = nvfp4.dequantize(layer.weight, layer.weight_scale, layer.weight_global_scale)

    def apply_weights(self, layer, x, bias=None):
        return F.linear(x, self.dense, bias)


@pytest.fixture
def kernel_method(monkeypatch):
    FakeKernel.made = []
    monkeypatch.setattr(nvcfg, "vllm_w4a16_kernel", FakeKernel)
    monkeypatch.setattr(nvcfg, "linear_method_class", lambda _: nvcfg.NvFp4KernelLinearMethod)


def test_vllms_max_global_scale_would_misscale_the_smaller_shard():
    gate, up = _four_x_shards()
    top = torch.maximum(gate.weight_scale_2, up.weight_scale_2)
    with_max = nvfp4.dequantize(gate.weight, gate.weight_scale, top)
    assert torch.equal(with_max, 4 * gate.dequantize())  # what a fold / split must avoid


def test_kernel_method_folds_a_power_of_two_ratio_into_the_block_scales(qc, kernel_method):
    layer = _gate_up(qc, 64, 48, dtype=torch.bfloat16)
    assert type(layer.quant_method) is nvcfg.NvFp4KernelLinearMethod
    gate, up = _four_x_shards()
    load_module(layer, _tensors(gate, input_scale=True), shard_id=0)
    load_module(layer, _tensors(up, input_scale=True), shard_id=1)
    layer.quant_method.process_weights_after_loading(layer)
    assert len(FakeKernel.made) == 1 and layer.quant_method.shard_kernels is None
    assert layer.is_w4a16_nvfp4 and not hasattr(layer, "input_scale")
    assert float(layer.weight_global_scale) == float(up.weight_scale_2)
    reference = torch.cat([gate.dequantize(), up.dequantize()])
    assert torch.equal(FakeKernel.made[0].dense, reference)  # bit-identical weights
    x = _x(4, 64)
    assert torch.equal(layer(x)[0], x @ reference.T)


def test_kernel_method_splits_shards_when_folding_is_inexact(qc, kernel_method):
    layer = _gate_up(qc, 64, 48, dtype=torch.bfloat16)
    up = _weight(48, 64, seed=2)
    gate = _weight(48, 64, seed=3, global_scale=float(up.weight_scale_2) / 3)  # ratio 3
    load_module(layer, _tensors(gate), shard_id=0)
    load_module(layer, _tensors(up), shard_id=1)
    layer.quant_method.process_weights_after_loading(layer)
    assert len(FakeKernel.made) == 2 and len(layer.nvfp4_shards) == 2
    assert torch.equal(FakeKernel.made[0].dense, gate.dequantize())
    assert torch.equal(FakeKernel.made[1].dense, up.dequantize())
    x = _x(4, 64)
    expected = torch.cat([x @ gate.dequantize().T, x @ up.dequantize().T], dim=-1)
    assert torch.equal(layer(x)[0], expected)


class LayerReadingKernel(FakeKernel):
    """A kernel that, like vLLM 0.33's Humming NVFP4 kernel (its choice on Hopper when installed),
    reads the layer's partition sizes, dtype, bias flag and parameters, not only its sizes."""

    def process_weights_after_loading(self, layer):
        k = layer.input_size_per_partition
        self.read = {
            "output_partition_sizes": list(layer.output_partition_sizes),
            "input_size_per_partition": k,
            "params_dtype": layer.params_dtype,
            "has_bias": layer.has_bias,
            "parameters": sorted(name for name, _ in layer.named_parameters(recurse=False)),
        }
        assert sum(self.read["output_partition_sizes"]) == layer.weight.shape[0]
        assert layer.weight.shape[1] * 2 == k
        super().process_weights_after_loading(layer)


@pytest.mark.parametrize("ratio,kernels", [(4.0, 1), (3.0, 2)])  # folded / one GEMM per shard
def test_kernels_that_read_the_layer_get_a_linear_layers_attributes(
    qc, monkeypatch, ratio, kernels
):
    FakeKernel.made = []
    monkeypatch.setattr(nvcfg, "vllm_w4a16_kernel", LayerReadingKernel)
    monkeypatch.setattr(nvcfg, "linear_method_class", lambda _: nvcfg.NvFp4KernelLinearMethod)
    layer = _gate_up(qc, 64, 48, dtype=torch.bfloat16)
    up = _weight(48, 64, seed=2)
    gate = _weight(48, 64, seed=3, global_scale=float(up.weight_scale_2) / ratio)
    load_module(layer, _tensors(gate), shard_id=0)
    load_module(layer, _tensors(up), shard_id=1)
    layer.quant_method.process_weights_after_loading(layer)
    assert len(FakeKernel.made) == kernels
    sizes = [[48, 48]] if kernels == 1 else [[48], [48]]
    assert [k.read["output_partition_sizes"] for k in FakeKernel.made] == sizes
    for k in FakeKernel.made:
        assert k.read["input_size_per_partition"] == 64
        assert k.read["params_dtype"] == torch.bfloat16 and k.read["has_bias"] is False
        assert k.read["parameters"] == ["weight", "weight_global_scale", "weight_scale"]
    x = _x(4, 64)
    expected = torch.cat([x @ gate.dequantize().T, x @ up.dequantize().T], dim=-1)
    assert torch.equal(layer(x)[0], expected)


def test_kernel_method_keeps_markov_w2_for_the_gathered_projection(qc, kernel_method):
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    layer = ParallelLMHead(
        128, 64, bias=False, quant_config=qc, prefix="markov_head.markov_w2", disable_tp=True,
        params_dtype=torch.bfloat16,
    )  # fmt: skip
    layer._retain_weight_for_gather = True  # as vLLM's DSparkMarkovHead sets it
    q = _weight(128, 64, seed=9)
    load_module(layer, _tensors(q))
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.is_w4a16_nvfp4
    assert torch.equal(layer._nvfp4_weight_for_gather, q.weight)
    assert torch.equal(layer._nvfp4_weight_scale_for_gather.float(), q.weight_scale.float())
    assert float(layer._nvfp4_weight_global_scale_for_gather) == float(q.weight_scale_2)
    assert layer._nvfp4_group_size_for_gather == 16


def test_fold_global_scales_only_where_exact():
    scales = torch.tensor([[448.0, 1.0], [0.5, 2.0], [3.0, 6.0]]).to(torch.float8_e4m3fn)
    same = nvcfg.fold_global_scales(scales, torch.tensor([0.25, 0.25]), [1, 2])
    assert same is not None and same[0] is scales and float(same[1]) == 0.25
    folded, top = nvcfg.fold_global_scales(scales, torch.tensor([0.25, 1.0]), [1, 2])
    assert float(top) == 1.0
    assert folded.float().tolist() == [[112.0, 0.25], [0.5, 2.0], [3.0, 6.0]]
    assert nvcfg.fold_global_scales(scales, torch.tensor([1 / 3, 1.0]), [1, 2]) is None
    tiny = scales.clone()
    tiny[0, 1] = 2.0**-9  # the smallest e4m3 subnormal: a quarter of it is not representable
    assert nvcfg.fold_global_scales(tiny, torch.tensor([0.25, 1.0]), [1, 2]) is None
    assert nvcfg.fold_global_scales(scales, torch.tensor([0.0, 1.0]), [1, 2]) is None
    with pytest.raises(ValueError, match="do not fit"):
        nvcfg.fold_global_scales(scales, torch.tensor([1.0, 1.0]), [2, 2])
