"""The reference NVFP4 format (vllm_nemotron_spec.nvfp4.format): nibble order, code table, scale
math, rounding, shapes and errors. Pure torch; no vLLM."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_nemotron_spec.nvfp4 import format as nvfp4

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _random_nvfp4(out_features: int, in_features: int, seed: int, global_scale: float = 0.01):
    """Random packed codes and block scales where every block holds a code of magnitude 6 (so the
    block's amax is exactly 6 * scale * global) and the largest block scale is 448."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out_features, in_features), generator=g, dtype=torch.uint8)
    codes.view(out_features, -1, nvfp4.GROUP_SIZE)[:, :, 0] = 7  # +6 in every block
    exponents = torch.randint(-6, 9, (out_features, in_features // nvfp4.GROUP_SIZE), generator=g)
    mantissas = torch.randint(8, 16, exponents.shape, generator=g).float() / 8
    scales = (mantissas * torch.pow(2.0, exponents.float())).clamp(max=448.0)
    scales[0, 0] = 448.0
    scales = scales.to(torch.float8_e4m3fn)
    return nvfp4.NVFP4Weight(nvfp4.pack_codes(codes), scales, torch.tensor(global_scale)), codes


def test_e2m1_table_is_the_sixteen_codes():
    table = nvfp4.e2m1_table()
    assert table.tolist() == E2M1
    assert torch.signbit(table[8])  # code 8 is negative zero
    assert nvfp4.e2m1_table(torch.bfloat16).dtype == torch.bfloat16


def test_element_2j_is_the_low_nibble():
    codes = torch.tensor([[1, 2, 15, 7]], dtype=torch.uint8)
    packed = nvfp4.pack_codes(codes)
    assert packed.tolist() == [[0x21, 0x7F]]
    assert torch.equal(nvfp4.unpack_codes(packed), codes)


def test_dequantize_a_known_byte_pattern():
    # Row 0: bytes 0x7F, 0x21 -> codes 15, 7, 1, 2 -> -6, 6, 0.5, 1 then 12 zeros.
    packed = torch.zeros(2, 8, dtype=torch.uint8)
    packed[0, 0], packed[0, 1] = 0x7F, 0x21
    packed[1] = 0x99  # code 9 (-0.5) everywhere
    scale = torch.tensor([[2.0], [0.5]]).to(torch.float8_e4m3fn)
    dense = nvfp4.dequantize(packed, scale, torch.tensor(0.25))
    assert dense[0, :4].tolist() == [-3.0, 3.0, 0.25, 0.5]
    assert dense[0, 4:].abs().sum() == 0
    assert dense[1].tolist() == [-0.0625] * 16


def test_every_code_dequantizes_to_its_value():
    codes = torch.arange(16, dtype=torch.uint8).reshape(1, 16)
    dense = nvfp4.dequantize(
        nvfp4.pack_codes(codes), torch.ones(1, 1).to(torch.float8_e4m3fn), torch.tensor(1.0)
    )
    assert dense.flatten().tolist() == E2M1


def test_dequantize_is_code_times_block_scale_times_global_in_fp32():
    q, codes = _random_nvfp4(8, 64, seed=1, global_scale=0.0123)
    dense = q.dequantize()
    values = torch.tensor(E2M1)[codes.long()]
    blocks = q.weight_scale.float().repeat_interleave(nvfp4.GROUP_SIZE, dim=1)
    assert torch.equal(dense, values * blocks * torch.tensor(0.0123, dtype=torch.float32))
    assert torch.equal(q.dequantize(torch.bfloat16), dense.to(torch.bfloat16))


def test_scale_math_follows_the_modelopt_recipe():
    torch.manual_seed(0)
    w = torch.randn(32, 64) * 0.05
    w[3, 17] = 0.9  # the tensor's amax
    q = nvfp4.quantize(w)
    assert q.weight_scale_2.dtype == torch.float32 and q.weight_scale_2.dim() == 0
    amax = float(w.abs().max())  # fp32(0.9)
    assert float(q.weight_scale_2) == float(torch.tensor(amax / (6 * 448), dtype=torch.float32))
    block_amax = w.reshape(32, 4, 16).abs().amax(-1)
    expected = (block_amax / 6 / q.weight_scale_2).to(torch.float8_e4m3fn)
    assert torch.equal(q.weight_scale.float(), expected.float())
    assert float(q.weight_scale[3, 1]) == 448.0  # the amax's block uses the full fp8 range
    assert q.weight_scale.dtype == torch.float8_e4m3fn and q.weight.dtype == torch.uint8


def test_quantization_error_is_within_half_a_step():
    torch.manual_seed(1)
    w = torch.randn(16, 128)
    q = nvfp4.quantize(w)
    step = q.weight_scale.float().repeat_interleave(16, dim=1) * q.weight_scale_2
    # The widest gap between neighbouring E2M1 values is 2 (4 -> 6); block-scale rounding to fp8
    # can push a value past 6 * scale, where it saturates (at most 2**-4 relative).
    assert bool(((w - q.dequantize()).abs() <= step * 1.0 + w.abs() * 2**-4).all())


def test_ties_round_to_the_even_code():
    #            tie: 0.25 0.75 1.25 1.75 2.5 3.5  5   and negatives; amax 6 makes the block scale 1
    w = torch.tensor([[6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75,
                       -2.5, -3.5, -5.0, 0.26]])  # fmt: skip
    q = nvfp4.quantize(w, global_scale=1.0)
    assert float(q.weight_scale[0, 0]) == 1.0
    codes = nvfp4.unpack_codes(q.weight)[0].tolist()
    assert codes == [7, 0, 2, 2, 4, 4, 6, 6, 0, 10, 10, 12, 12, 14, 14, 1]
    assert q.dequantize()[0].tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.0, -1.0, -1.0,
                                          -2.0, -2.0, -4.0, -4.0, 0.5]  # fmt: skip


def test_values_beyond_the_block_range_saturate():
    # global scale 1/448 caps the block scale at 448 -> one unit; 10 saturates to 6.
    q = nvfp4.quantize(torch.full((1, 16), 10.0), global_scale=1 / 448)
    assert float(q.weight_scale[0, 0]) == 448.0
    assert nvfp4.unpack_codes(q.weight).unique().tolist() == [7]


def test_zero_weight():
    q = nvfp4.quantize(torch.zeros(4, 32))
    assert float(q.weight_scale_2) == 1.0
    assert q.weight.sum() == 0 and q.weight_scale.float().sum() == 0
    assert q.dequantize().abs().sum() == 0


@settings(max_examples=25, deadline=None)
@given(
    out_features=st.integers(1, 6),
    blocks=st.integers(1, 4),
    seed=st.integers(0, 2**31 - 1),
    global_scale=st.sampled_from([1.0, 0.01, 3.7e-4, 2.0**-20]),
)
def test_quantize_reproduces_a_quantized_weight(out_features, blocks, seed, global_scale):
    q, codes = _random_nvfp4(out_features, blocks * 16, seed, global_scale)
    again = nvfp4.quantize(q.dequantize(), global_scale=float(q.weight_scale_2))
    assert torch.equal(again.weight_scale.float(), q.weight_scale.float())
    # -0 (code 8) comes back as +0 (code 0); every other code is reproduced.
    back = nvfp4.unpack_codes(again.weight)
    assert torch.equal(back, torch.where(codes == 8, torch.zeros_like(codes), codes))
    assert torch.equal(again.dequantize(), q.dequantize())


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 5), pairs=st.integers(1, 20), seed=st.integers(0, 2**31 - 1))
def test_pack_unpack_round_trip(rows, pairs, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, 2 * pairs), generator=g, dtype=torch.uint8)
    packed = nvfp4.pack_codes(codes)
    assert packed.shape == (rows, pairs) and packed.dtype == torch.uint8
    assert torch.equal(nvfp4.unpack_codes(packed), codes)
    assert torch.equal(nvfp4.pack_codes(nvfp4.unpack_codes(packed)), packed)


def test_shapes_of_the_real_draft_tensors():
    assert nvfp4.packed_shape((2688, 16128)) == (2688, 8064)  # fc
    assert nvfp4.scale_shape((2688, 16128)) == (2688, 1008)
    assert nvfp4.logical_shape((2688, 8064)) == (2688, 16128)
    assert nvfp4.packed_shape((131072, 512)) == (131072, 256)  # markov_w2
    assert nvfp4.scale_shape((131072, 512)) == (131072, 32)
    q = nvfp4.quantize(torch.randn(4, 32))
    assert q.logical_shape == (4, 32)
    assert sorted(q.tensors("layers.0.mlp.up_proj")) == [
        "layers.0.mlp.up_proj.weight",
        "layers.0.mlp.up_proj.weight_scale",
        "layers.0.mlp.up_proj.weight_scale_2",
    ]


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: nvfp4.packed_shape((8, 24)), ValueError, "divisible by 16"),
        (lambda: nvfp4.scale_shape((8,)), ValueError, "2-D"),
        (lambda: nvfp4.logical_shape((2, 3, 4)), ValueError, "2-D"),
        (lambda: nvfp4.quantize(torch.randn(4, 20)), ValueError, "divisible by 16"),
        (lambda: nvfp4.unpack_codes(torch.zeros(2, 2, dtype=torch.int8)), TypeError, "uint8"),
        (lambda: nvfp4.pack_codes(torch.zeros(2, 3, dtype=torch.uint8)), ValueError, "odd"),
        (lambda: nvfp4.pack_codes(torch.tensor([[3, 16]])), ValueError, "0..15"),
        (lambda: nvfp4.pack_codes(torch.tensor([[3, -1]])), ValueError, "0..15"),
        (lambda: nvfp4.pack_codes(torch.tensor([[3, 256]], dtype=torch.int16)), ValueError, "15"),
        (lambda: nvfp4.pack_codes(torch.tensor([[1.0, 2.0]])), TypeError, "integer"),
    ],
)
def test_bad_shapes_and_dtypes_raise(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_dequantize_checks_its_inputs():
    weight = torch.zeros(4, 16, dtype=torch.uint8)  # logical [4, 32]
    scale = torch.ones(4, 2).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"weight_scale has shape \(4, 1\), expected \(4, 2\)"):
        nvfp4.dequantize(weight, scale[:, :1], 1.0)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        nvfp4.dequantize(weight, scale.float(), 1.0)
    with pytest.raises(ValueError, match="scalar"):
        nvfp4.dequantize(weight, scale, torch.ones(2))
    with pytest.raises(TypeError, match="uint8"):
        nvfp4.dequantize(weight.to(torch.int32), scale, 1.0)
