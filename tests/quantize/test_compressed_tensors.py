"""A draft quantized NVFP4 weight-only by the compressed-tensors library (``nvfp4-pack-quantized``),
loaded through the plugin's ``nemotron_ct_w4a16_nvfp4`` config: conventions, claims, exact CPU
dequantization, and the draft's ignore list under vLLM's layer names.

The plugin computes ``(E2M1 * scale) * float32(1 / global)`` (ModelOpt's form, what vLLM's
kernels compute), compressed-tensors ``E2M1 * float32(scale / global)``: the two round at
different points, so the tests bound each against the exact value instead of against each other.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tests.quantize.util import bits_equal, tensors
from vllm_nemotron_spec.nvfp4 import compressed_tensors as ct
from vllm_nemotron_spec.nvfp4 import format as nvfp4


def _qcfg(path) -> dict:
    return json.loads((path / "config.json").read_text())["quantization_config"]


def _modules(t: dict) -> list[str]:
    return sorted(k[: -len(".weight_packed")] for k in t if k.endswith(".weight_packed"))


# ------------------------------------------------------------------------------------------
# The fixture and the conventions
# ------------------------------------------------------------------------------------------


def test_fixture_is_compressed_tensors_nvfp4a16(ct_dflash):
    q = _qcfg(ct_dflash)
    assert q["quant_method"] == "compressed-tensors" and q["format"] == ct.CT_NVFP4_FORMAT
    (group,) = q["config_groups"].values()
    assert group["input_activations"] is None
    w = group["weights"]
    assert (w["num_bits"], w["type"], w["strategy"], w["group_size"]) == (
        4,
        "float",
        "tensor_group",
        16,
    )
    assert sorted(q["ignore"]) == sorted(
        f"layers.{i}.self_attn.{p}_proj" for i in range(6) for p in "qkvo"
    )
    t = tensors(ct_dflash)
    assert _modules(t) == sorted(
        ["fc"] + [f"layers.{i}.mlp.{p}_proj" for i in range(6) for p in ("gate", "up", "down")]
    )
    for m in _modules(t):
        out, inp = t[f"{m}.weight_packed"].shape[0], t[f"{m}.weight_packed"].shape[1] * 2
        assert t[f"{m}.weight_packed"].dtype == torch.uint8
        assert t[f"{m}.weight_scale"].dtype == torch.float8_e4m3fn
        assert tuple(t[f"{m}.weight_scale"].shape) == (out, inp // 16)
        assert t[f"{m}.weight_global_scale"].dtype == torch.float32
        assert tuple(t[f"{m}.weight_global_scale"].shape) == (1,)
    assert t["layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16


def test_packing_and_code_table_are_modelopts(ct_dflash):
    """compressed-tensors' own unpacking gives exactly the values of nvfp4.format's table under
    nvfp4.format's nibble order (element 2j in the low nibble, sign in bit 3)."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

    t = tensors(ct_dflash)
    for m in _modules(t):
        packed = t[f"{m}.weight_packed"]
        theirs = unpack_fp4_from_uint8(
            packed, packed.shape[0], packed.shape[1] * 2, dtype=torch.float32
        )
        ours = nvfp4.e2m1_table()[nvfp4.unpack_codes(packed).long()]
        assert torch.equal(theirs, ours), m


def test_global_scale_is_the_reciprocal_of_modelopts(bf16_dflash, ct_dflash):
    """compressed-tensors' global scale is 448 * 6 / amax; ModelOpt's weight_scale_2 is
    amax / (6 * 448): reciprocals (modules whose global scale was not shared with a fused
    sibling)."""
    source, t = tensors(bf16_dflash), tensors(ct_dflash)
    for m in ["fc"] + [f"layers.{i}.mlp.down_proj" for i in range(6)]:
        g = float(t[f"{m}.weight_global_scale"])
        ws2 = float(nvfp4.quantize(source[f"{m}.weight"].float()).weight_scale_2)
        assert abs(g * ws2 - 1.0) < 1e-6, m


def test_compressed_tensors_own_modelopt_converter_agrees(bf16_dflash):
    """compressed-tensors' ModelOpt -> compressed-tensors converter renames weight to
    weight_packed, keeps weight_scale and inverts weight_scale_2: the same relation."""
    from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import (
        ModelOptNvfp4Converter,
    )

    q = nvfp4.quantize(tensors(bf16_dflash)["fc.weight"].float())
    converted = ModelOptNvfp4Converter(targets=["re:.*fc$"]).process(dict(q.tensors("fc")))
    assert bits_equal(converted["fc.weight_packed"], q.weight)
    assert bits_equal(converted["fc.weight_scale"], q.weight_scale)
    assert float(converted["fc.weight_global_scale"]) == float(1 / q.weight_scale_2)
    deq = ct.dequantize(
        converted["fc.weight_packed"],
        converted["fc.weight_scale"],
        converted["fc.weight_global_scale"],
    )
    torch.testing.assert_close(deq, q.dequantize(), rtol=2.0**-22, atol=0)


# ------------------------------------------------------------------------------------------
# Which checkpoints the config claims
# ------------------------------------------------------------------------------------------


def test_claims_only_compressed_tensors_nvfp4_weight_only(ct_dflash):
    q = _qcfg(ct_dflash)
    assert ct.ct_nvfp4_weight_only(q)
    w4a4 = json.loads(json.dumps(q))
    w4a4["config_groups"]["group_0"]["input_activations"] = dict(
        q["config_groups"]["group_0"]["weights"], dynamic="local"
    )
    assert not ct.ct_nvfp4_weight_only(w4a4)
    int4 = json.loads(json.dumps(q))
    int4["config_groups"]["group_0"]["weights"].update(type="int", strategy="group", group_size=128)
    int4["format"] = int4["config_groups"]["group_0"]["format"] = "pack-quantized"
    assert not ct.ct_nvfp4_weight_only(int4)
    modelopt = {"quant_method": "modelopt", "quant_algo": "W4A16_NVFP4", "group_size": 16}
    assert not ct.ct_nvfp4_weight_only(modelopt)
    assert not ct.ct_nvfp4_weight_only(None)


def test_override_on_cpu_and_gpu(ct_dflash, bf16_dflash, monkeypatch):
    from vllm.platforms import current_platform

    C = ct.NemotronCTW4A16NvFp4Config
    q = _qcfg(ct_dflash)
    draft_cfg = json.loads((ct_dflash / "config.json").read_text())
    target_like = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
    assert C.override_quantization_method(q, None, hf_config=draft_cfg) == ct.NAME
    assert C.override_quantization_method(q, "compressed-tensors") is None  # explicit wins
    assert C.override_quantization_method({"quant_method": "modelopt"}, None) is None
    with pytest.raises(ValueError, match="NVFP4 weight-only"):
        C.override_quantization_method({"quant_method": "modelopt"}, ct.NAME)
    # GPU: only Nemotron 3.5 drafts are claimed (the scheme stays vLLM's); targets are not.
    monkeypatch.setattr(current_platform.__class__, "is_cpu", lambda self=None: False)
    assert C.override_quantization_method(q, None, hf_config=draft_cfg) == ct.NAME
    assert C.override_quantization_method(q, None, hf_config=target_like) is None


def test_plugin_registers_the_config():
    from vllm.model_executor.layers.quantization import (
        QUANTIZATION_METHODS,
        get_quantization_config,
    )

    from vllm_nemotron_spec import plugin

    done = plugin.register()
    assert any(ct.NAME in item for item in done)
    assert ct.NAME in QUANTIZATION_METHODS
    assert get_quantization_config(ct.NAME) is ct.NemotronCTW4A16NvFp4Config


# ------------------------------------------------------------------------------------------
# vLLM layers on CPU: exact dequantization
# ------------------------------------------------------------------------------------------


@pytest.fixture
def qc(vllm_ctx, ct_dflash):
    return ct.NemotronCTW4A16NvFp4Config.from_config(_qcfg(ct_dflash))


def _load(layer, t: dict, module: str, shard_id=None) -> None:
    for name in ("weight_packed", "weight_scale", "weight_global_scale"):
        param = getattr(layer, name)
        args = () if shard_id is None else (shard_id,)
        param.weight_loader(param, t[f"{module}.{name}"], *args)


def _reference(t: dict, module: str) -> torch.Tensor:
    return nvfp4.dequantize(
        t[f"{module}.weight_packed"],
        t[f"{module}.weight_scale"],
        torch.reciprocal(t[f"{module}.weight_global_scale"]).reshape(()),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fc_dequantizes_exactly_on_cpu(qc, ct_dflash, dtype):
    from vllm.model_executor.layers.linear import ReplicatedLinear

    t = tensors(ct_dflash)
    out, inp = t["fc.weight_packed"].shape[0], t["fc.weight_packed"].shape[1] * 2
    layer = ReplicatedLinear(
        inp, out, bias=False, quant_config=qc, prefix="model.fc", params_dtype=dtype
    )
    assert type(layer.scheme) is ct.CompressedTensorsW4A16NvFp4Dequantized
    _load(layer, t, "fc")
    layer.quant_method.process_weights_after_loading(layer)
    expected = _reference(t, "fc").to(dtype)
    assert bits_equal(layer.weight.data, expected)
    assert not hasattr(layer, "weight_packed") and not hasattr(layer, "weight_global_scale")
    x = torch.randn(5, inp, generator=torch.Generator().manual_seed(3)).to(dtype)
    assert torch.equal(layer(x)[0], F.linear(x, expected))


def test_fused_gate_up_with_different_global_scales_is_exact(qc, ct_dflash):
    """gate from layer 0 and up from layer 3 in one fused layer: different global scales, each
    shard dequantized with its own (vLLM's GPU scheme would use one for both)."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    t = tensors(ct_dflash)
    gate, up = "layers.0.mlp.gate_proj", "layers.3.mlp.up_proj"
    assert float(t[f"{gate}.weight_global_scale"]) != float(t[f"{up}.weight_global_scale"])
    inter, hidden = t[f"{gate}.weight_packed"].shape[0], t[f"{gate}.weight_packed"].shape[1] * 2
    layer = MergedColumnParallelLinear(
        hidden,
        [inter, inter],
        bias=False,
        quant_config=qc,
        prefix="model.layers.14.mlp.gate_up_proj",
        params_dtype=torch.float32,
    )
    _load(layer, t, gate, 0)
    _load(layer, t, up, 1)
    layer.quant_method.process_weights_after_loading(layer)
    expected = torch.cat([_reference(t, gate), _reference(t, up)])
    assert bits_equal(layer.weight.data, expected)


def test_a_wrong_tensor_is_named(qc, ct_dflash):
    from vllm.model_executor.layers.linear import ReplicatedLinear

    t = tensors(ct_dflash)
    out, inp = t["fc.weight_packed"].shape[0], t["fc.weight_packed"].shape[1] * 2
    layer = ReplicatedLinear(
        inp, out, bias=False, quant_config=qc, prefix="model.fc", params_dtype=torch.float32
    )
    with pytest.raises(ValueError, match=r"model\.fc\.weight_packed: found torch\.bfloat16"):
        layer.weight_packed.weight_loader(
            layer.weight_packed, torch.zeros(out, inp, dtype=torch.bfloat16)
        )
    with pytest.raises(RuntimeError, match=r"model\.fc\.weight_scale was never loaded"):
        layer.quant_method.process_weights_after_loading(layer)


FP32_UNIT_ROUNDOFF = 2.0**-24
# Both forms round twice after the exact product E2M1 * scale (at most 6 significant bits):
#   ours   (ModelOpt, vLLM's kernels): (c * s) * fl(1 / g)  -> fl(1/g), then the product
#   theirs (compressed-tensors)      : c * fl(s / g)         -> fl(s/g), then the product
# so each is within (1 + u)^2 - 1 = 2u + u^2 of c * s / g; the float64 reference adds at most
# 2^-53 relative, well inside the extra u^2.
TWO_ROUNDINGS = 2 * FP32_UNIT_ROUNDOFF + 2 * FP32_UNIT_ROUNDOFF**2


def _exact_dequantize(codes: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor):
    """E2M1 * scale / global in float64: exact but for one rounding of 2^-53."""
    block = scale.to(torch.float64).repeat_interleave(16, dim=1)
    return codes.to(torch.float64) * block / global_scale.to(torch.float64)


def _worst_relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """Largest |approx - exact| / |exact|; infinite where exact is 0 and approx is not."""
    err = (approx.to(torch.float64) - exact).abs()
    nonzero = exact != 0
    if torch.any(err[~nonzero] != 0):
        return float("inf")
    return float((err[nonzero] / exact[nonzero].abs()).max())


def test_against_compressed_tensors_own_dequantization(ct_dflash):
    """The plugin's weights against compressed-tensors' arithmetic, each within two fp32 roundings
    of the exact float64 value (the bound holds for every code, block scale and global scale,
    so for any trained weights); the two forms agree bit for bit when the global scale is a
    power of two (``1 / g`` exact). A swapped nibble or a wrong block scale breaks the bound."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize

    t = tensors(ct_dflash)
    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    for m in _modules(t):
        packed, scale, g = (
            t[f"{m}.{k}"] for k in ("weight_packed", "weight_scale", "weight_global_scale")
        )
        ours = ct.dequantize(packed, scale, g)
        codes = unpack_fp4_from_uint8(packed, *ours.shape, dtype=torch.float32)
        theirs = ct_dequantize(x_q=codes, scale=scale.float(), global_scale=g, dtype=torch.float32)
        exact = _exact_dequantize(codes, scale, g)
        # the bound is for normal numbers (subnormals round absolutely)
        assert exact[exact != 0].abs().min() >= torch.finfo(torch.float32).tiny, m
        assert _worst_relative_error(ours, exact) <= TWO_ROUNDINGS, m
        assert _worst_relative_error(theirs, exact) <= TWO_ROUNDINGS, m
        # The checks catch layout errors: nibbles swapped in each byte, a block scale doubled.
        swapped = ((packed & 0x0F) << 4) | (packed >> 4)
        assert _worst_relative_error(ct.dequantize(swapped, scale, g), exact) > 0.1, m
        doubled = (scale.float() * 2).to(torch.float8_e4m3fn)
        assert _worst_relative_error(ct.dequantize(packed, doubled, g), exact) > 0.1, m
        # compressed-tensors' decompress is its fp32 arithmetic rounded to bf16
        decompressed = NVFP4PackedCompressor.decompress(
            {"weight_packed": packed, "weight_scale": scale, "weight_global_scale": g}, scheme
        )["weight"]
        assert decompressed.dtype == torch.bfloat16
        assert torch.equal(theirs.to(torch.bfloat16), decompressed), m
        # a power-of-two global scale: 1 / g is exact, so the two forms agree bit for bit
        g2 = torch.tensor([2.0**14])
        a = ct.dequantize(packed, scale, g2)
        b = ct_dequantize(x_q=codes, scale=scale.float(), global_scale=g2, dtype=torch.float32)
        assert bits_equal(a, b), m


# ------------------------------------------------------------------------------------------
# The draft's ignore list under vLLM's layer names
# ------------------------------------------------------------------------------------------


def test_ignore_list_matches_vllms_draft_layer_names(qc):
    """vLLM builds draft layer i as ``model.layers.{i + target layers}`` and fuses q/k/v; the
    checkpoint's ignore list names ``layers.{i}.self_attn.q_proj``. vLLM's own config misses it
    (it then builds an NVFP4 qkv_proj for a BF16 checkpoint tensor); ours finds it."""
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )
    from vllm.model_executor.models.qwen3_dflash import _add_global_draft_layer_exclusions

    layer = torch.nn.Linear(2, 2)
    _add_global_draft_layer_exclusions(qc, 14, 6)  # what DFlashQwen3Model does at init
    assert qc.get_scheme_dict(layer, "model.layers.14.self_attn.qkv_proj") is None
    assert qc.get_scheme_dict(layer, "model.layers.19.self_attn.o_proj") is None
    assert qc.get_scheme_dict(layer, "model.layers.14.mlp.gate_up_proj")["weights"] is not None
    assert qc.get_scheme_dict(layer, "model.fc")["weights"] is not None
    vllms = CompressedTensorsConfig.from_config(json.loads(json.dumps(qc.config)))
    _add_global_draft_layer_exclusions(vllms, 14, 6)
    assert vllms.get_scheme_dict(layer, "model.layers.14.self_attn.qkv_proj") is not None


def test_regex_ignore_entries_work_too(vllm_ctx, ct_dflash):
    q = _qcfg(ct_dflash)
    q["ignore"] = ["re:.*self_attn.*"]
    qc = ct.NemotronCTW4A16NvFp4Config.from_config(q)
    layer = torch.nn.Linear(2, 2)
    assert qc.get_scheme_dict(layer, "model.layers.14.self_attn.qkv_proj") is None
    assert qc.get_scheme_dict(layer, "model.layers.14.mlp.down_proj") is not None
