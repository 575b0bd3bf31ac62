"""NVFP4 layers under tensor parallelism, one rank at a time on CPU: each rank's shard, loaded by
vLLM's own weight loaders into the plugin's linear methods, dequantizes to exactly the slice of the
full dequantized weight.

The tensor-parallel rank and size are faked by replacing vLLM's ``get_tensor_model_parallel_rank`` /
``_world_size`` where the layers and parameters read them (no process group: the per-rank outputs
are compared instead of running the collectives). NVFP4 packs along the input dimension: a
column-parallel layer splits rows (packed weight, block scales and the shard's own global scale
travel together); a row-parallel layer splits columns, the packed weight by half the logical
columns and the block scales by a sixteenth, so each rank's part must start on a 16-column block.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_nemotron_spec.nvfp4 import config as nvcfg
from vllm_nemotron_spec.nvfp4 import format as nvfp4

CONFIG = {"quant_method": "modelopt", "quant_algo": "W4A16_NVFP4", "group_size": 16}
IGNORE = ["lm_head", "embed_tokens", "layers.*.self_attn*", "markov_head.markov_w1"]
G = nvfp4.GROUP_SIZE


@pytest.fixture
def qc(vllm_ctx):
    return nvcfg.NemotronW4A16NvFp4Config.from_config({**CONFIG, "ignore": IGNORE})


@pytest.fixture
def set_tp(monkeypatch):
    """``set_tp(rank, size)``: what vLLM's layers and parameters built afterwards see as the tensor
    parallel rank and world size."""
    from vllm.model_executor import parameter
    from vllm.model_executor.layers import linear, vocab_parallel_embedding

    def set_tp(rank: int, size: int) -> None:
        for module in (parameter, linear, vocab_parallel_embedding):
            monkeypatch.setattr(module, "get_tensor_model_parallel_rank", lambda: rank)
            monkeypatch.setattr(module, "get_tensor_model_parallel_world_size", lambda: size)

    return set_tp


class FakeKernel:
    """Stands in for vLLM's GPU W4A16 kernel: computes from the tensors it is given, with ONE
    global scale (as Marlin / CuTe do)."""

    def process_weights_after_loading(self, layer):
        self.dense = nvfp4.dequantize(layer.weight, layer.weight_scale, layer.weight_global_scale)

    def apply_weights(self, layer, x, bias=None):
        return F.linear(x, self.dense, bias)


@pytest.fixture(params=["cpu", "kernel"])
def method(request, monkeypatch):
    """Which of the plugin's linear methods the layers get: the CPU one (dequantized once) or the
    GPU one (vLLM's kernel, here :class:`FakeKernel`; shard global scales folded or split)."""
    if request.param == "kernel":
        monkeypatch.setattr(nvcfg, "vllm_w4a16_kernel", FakeKernel)
        monkeypatch.setattr(nvcfg, "linear_method_class", lambda _: nvcfg.NvFp4KernelLinearMethod)
    return request.param


def _weight(out_features, in_features, seed, global_scale=None, std=0.05):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g) * std
    return nvfp4.quantize(w, global_scale=global_scale)


def _load(layer, q: nvfp4.NVFP4Weight, shard_id=None) -> None:
    """One checkpoint module's tensors through the parameters' weight loaders (full tensors: the
    loader takes this rank's part), as a vLLM model's load_weights does."""
    args = () if shard_id is None else (shard_id,)
    for name in ("weight", "weight_scale", "weight_scale_2"):
        param = getattr(layer, name)
        param.weight_loader(param, getattr(q, name), *args)


def _x(m, k, seed=7):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed))


def _dense(layer, method: str) -> torch.Tensor:
    """The weight a loaded, processed layer computes with (dequantized)."""
    if method == "cpu":
        return layer.weight
    quant = layer.quant_method
    if quant.shard_kernels is None:
        return quant.kernel.dense
    return torch.cat([k.dense for k in quant.shard_kernels])


def _check_rank(layer, method: str, expected: torch.Tensor) -> None:
    expected_method = {
        "cpu": nvcfg.NvFp4DequantizedLinearMethod,
        "kernel": nvcfg.NvFp4KernelLinearMethod,
    }[method]
    assert type(layer.quant_method) is expected_method
    dense = _dense(layer, method)
    assert dense.shape == expected.shape
    assert torch.equal(dense, expected)
    x = _x(5, expected.shape[1])
    assert torch.equal(layer.quant_method.apply(layer, x), x @ expected.T)


def _rows(size: int, rank: int, tp: int) -> slice:
    return slice(rank * size // tp, (rank + 1) * size // tp)


@pytest.mark.parametrize("tp", [2, 4])
def test_column_parallel_rank_holds_its_rows(qc, set_tp, method, tp):
    from vllm.model_executor.layers.linear import ColumnParallelLinear

    q = _weight(96, 64, seed=1)
    full = q.dequantize()
    for rank in range(tp):
        set_tp(rank, tp)
        layer = ColumnParallelLinear(
            64, 96, bias=False, quant_config=qc, prefix="model.layers.0.mlp.up_proj",
            params_dtype=torch.float32,
        )  # fmt: skip
        _load(layer, q)
        rows = _rows(96, rank, tp)
        assert torch.equal(layer.weight.data, q.weight[rows])  # packed: whole rows
        assert torch.equal(layer.weight_scale.data.float(), q.weight_scale[rows].float())
        layer.quant_method.process_weights_after_loading(layer)
        _check_rank(layer, method, full[rows])


def _gate_up_with_global_scale_ratio(ratio: float, hidden=64, inter=96):
    up = _weight(inter, hidden, seed=2)
    gate = _weight(
        inter, hidden, seed=3, std=0.05 / ratio, global_scale=float(up.weight_scale_2) / ratio
    )
    assert float(up.weight_scale_2) == ratio * float(gate.weight_scale_2)
    return gate, up


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("ratio", [4.0, 3.0])  # folded exactly into block scales / split shards
def test_merged_gate_up_ranks_keep_each_shards_global_scale(qc, set_tp, method, tp, ratio):
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    gate, up = _gate_up_with_global_scale_ratio(ratio)
    for rank in range(tp):
        set_tp(rank, tp)
        layer = MergedColumnParallelLinear(
            64, [96, 96], bias=False, quant_config=qc, prefix="model.layers.0.mlp.gate_up_proj",
            params_dtype=torch.float32,
        )  # fmt: skip
        _load(layer, gate, shard_id=0)
        _load(layer, up, shard_id=1)
        assert layer.weight_scale_2.data.tolist() == [
            float(gate.weight_scale_2),
            float(up.weight_scale_2),
        ]
        layer.quant_method.process_weights_after_loading(layer)
        rows = _rows(96, rank, tp)
        expected = torch.cat([gate.dequantize()[rows], up.dequantize()[rows]])
        _check_rank(layer, method, expected)
        if method == "kernel":  # ratio 4 folds into one GEMM, ratio 3 cannot
            assert (layer.quant_method.shard_kernels is None) == (ratio == 4.0)


@pytest.mark.parametrize("tp", [2, 4])  # 4: more ranks than KV heads, each KV head on two ranks
def test_qkv_ranks_keep_each_shards_global_scale(qc, set_tp, method, tp):
    from vllm.model_executor.layers.linear import QKVParallelLinear

    head, heads, kv_heads = 16, 4, 2
    shards = {
        "q": _weight(heads * head, 64, seed=5),
        "k": _weight(kv_heads * head, 64, seed=6, std=0.2),
        "v": _weight(kv_heads * head, 64, seed=7, std=0.01),
    }
    assert len({float(q.weight_scale_2) for q in shards.values()}) == 3
    for rank in range(tp):
        set_tp(rank, tp)
        layer = QKVParallelLinear(
            64, head, heads, kv_heads, bias=False, quant_config=qc,
            prefix="model.layers.0.attn.qkv_proj", params_dtype=torch.float32,
        )  # fmt: skip
        for shard_id, q in shards.items():
            _load(layer, q, shard_id=shard_id)
        layer.quant_method.process_weights_after_loading(layer)
        kv_rank = rank * kv_heads // tp if tp > kv_heads else rank
        kv_rows = _rows(kv_heads * head, kv_rank, min(tp, kv_heads))
        expected = torch.cat(
            [
                shards["q"].dequantize()[_rows(heads * head, rank, tp)],
                shards["k"].dequantize()[kv_rows],
                shards["v"].dequantize()[kv_rows],
            ]
        )
        _check_rank(layer, method, expected)


@pytest.mark.parametrize("tp", [2, 6])  # 48 and 16 input columns per rank: 3 blocks and 1
def test_row_parallel_rank_holds_its_column_blocks(qc, set_tp, method, tp):
    from vllm.model_executor.layers.linear import RowParallelLinear

    q = _weight(64, 96, seed=4)
    full = q.dequantize()
    x = _x(3, 96)
    partial_sums = []
    for rank in range(tp):
        set_tp(rank, tp)
        layer = RowParallelLinear(
            96, 64, bias=False, quant_config=qc, prefix="model.layers.0.mlp.down_proj",
            params_dtype=torch.float32,
        )  # fmt: skip
        _load(layer, q)
        cols = _rows(96, rank, tp)
        packed = slice(cols.start // 2, cols.stop // 2)
        blocks = slice(cols.start // G, cols.stop // G)
        assert torch.equal(layer.weight.data, q.weight[:, packed])
        assert torch.equal(layer.weight_scale.data.float(), q.weight_scale[:, blocks].float())
        layer.quant_method.process_weights_after_loading(layer)
        _check_rank(layer, method, full[:, cols])
        partial_sums.append(layer.quant_method.apply(layer, x[:, cols]))
    # vLLM's all-reduce adds the ranks' partial products: the full product up to fp32 reordering,
    # |error| <= K * eps * sum |x| |w| for dot products of length K.
    bound = 96 * 2.0**-24 * (x.abs() @ full.abs().T)
    assert torch.all((sum(partial_sums) - x @ full.T).abs() <= bound)


def test_row_parallel_split_inside_a_block_is_refused(qc, set_tp):
    from vllm.model_executor.layers.linear import RowParallelLinear

    set_tp(0, 4)  # 96 input columns over 4 ranks: 24 each, not a whole number of 16-blocks
    with pytest.raises(
        ValueError,
        match=(
            r"model\.layers\.0\.mlp\.down_proj: NVFP4 needs the input size per partition divisible "
            r"by 16, got 24 \(input size 96\)"
        ),
    ):
        RowParallelLinear(
            96, 64, bias=False, quant_config=qc, prefix="model.layers.0.mlp.down_proj",
            params_dtype=torch.float32,
        )  # fmt: skip


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_the_real_drafts_down_proj_splits_on_blocks(qc, set_tp, tp):
    """The Nemotron 3.5 drafts' down_proj (6144 -> 2688) at TP 2 / 4 / 8: whole blocks per rank."""
    from vllm.model_executor.layers.linear import RowParallelLinear

    set_tp(tp - 1, tp)
    layer = RowParallelLinear(
        6144, 2688, bias=False, quant_config=qc, prefix="model.layers.0.mlp.down_proj",
        params_dtype=torch.bfloat16,
    )  # fmt: skip
    assert layer.weight.shape == (2688, 6144 // tp // 2)
    assert layer.weight_scale.shape == (2688, 6144 // tp // G)


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_markov_w2_ranks_hold_their_vocab_rows(qc, set_tp, tp):
    """DSpark's NVFP4 markov_w2 as a vocab-sharded ParallelLMHead (vLLM builds it replicated, with
    ``disable_tp=True``; this is the sharded form): each rank's rows, zero padding rows after the
    real vocabulary, and the ranks' outputs concatenated and cut to the vocabulary (what vLLM's
    logits processor does after its all-gather) equal the full head's."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    vocab, rank_dim = 200, 32  # padded to 256 rows: the last rank holds padding
    q = _weight(vocab, rank_dim, seed=8)
    full = q.dequantize()
    x = _x(6, rank_dim)
    outputs = []
    for rank in range(tp):
        set_tp(rank, tp)
        layer = ParallelLMHead(
            vocab, rank_dim, bias=False, quant_config=qc, prefix="markov_head.markov_w2",
            params_dtype=torch.float32,
        )  # fmt: skip
        assert layer.tp_size == tp
        _load(layer, q)
        layer.quant_method.process_weights_after_loading(layer)
        per_rank = layer.num_embeddings_per_partition
        assert per_rank == 256 // tp
        start = rank * per_rank
        real = full[start : start + per_rank]
        expected = torch.cat([real, torch.zeros(per_rank - real.shape[0], rank_dim)])
        _check_rank(layer, "cpu", expected)
        outputs.append(layer.quant_method.apply(layer, x))
    assert torch.equal(torch.cat(outputs, dim=-1)[:, :vocab], x @ full.T)
