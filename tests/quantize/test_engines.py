"""``--engine modelopt`` (nvidia-modelopt's own export) against ``--engine builtin`` on the trained
tiny DFlash draft: the exact difference.

Measured with nvidia-modelopt 0.47.0 on the tiny draft (19 modules, 983040 weights, 61440 blocks):

* ``weight_scale_2`` (global scales), configs, names, dtypes, shapes and every BF16 tensor:
  bit-identical;
* block scales: identical except 60 blocks (0.1%). Builtin computes
  ``fp8(block_amax / 6 / global)``, modelopt ``fp8(block_amax / (6 * global))`` (all-zero blocks
  -> 1.0, clamped to [2^-9, 448]). The exact value of those 60 lies on an fp8 rounding midpoint
  (within 4e-8 relative, below one fp32 ulp), so the two fp32 roundings of the two formulas fall
  on either side of the tie: the stored scales are one fp8 step apart;
* E2M1 codes in the other blocks: identical except that modelopt writes a negative weight that
  rounds to zero as code 8 (-0.0) where builtin writes code 0 (+0.0): 33913 codes (3.4%). The
  dequantized values are equal (-0.0 == 0.0); rounding ties of the codes (half to even) agree.
  (Inside the 60 tie blocks each engine's codes follow its own scale: 215 of their 960 differ.)
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.quantize.util import bits_equal, tensors
from vllm_nemotron_spec.nvfp4 import format as nvfp4

E4M3_MAX = 448.0


def _modelopt_block_scales(weight: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """nvidia-modelopt 0.47's rule (NVFP4QTensor.get_weights_scaling_factor), restated."""
    amax = weight.float().reshape(weight.shape[0], -1, nvfp4.GROUP_SIZE).abs().amax(-1)
    scale = amax / (nvfp4.E2M1_MAX * global_scale)
    scale[scale == 0] = 1.0
    return scale.clamp(min=2.0**-9, max=E4M3_MAX).to(torch.float8_e4m3fn)


def _fp8_midpoints() -> torch.Tensor:
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    grid = torch.unique(grid[torch.isfinite(grid) & (grid >= 0)])
    return (grid[1:] + grid[:-1]) / 2


@pytest.fixture(scope="module")
def compared(bf16_dflash, builtin_dflash, modelopt_dflash):
    return tensors(bf16_dflash), tensors(builtin_dflash), tensors(modelopt_dflash)


def test_modelopt_ran(modelopt_engine, modelopt_result):
    _, version = modelopt_engine
    info = modelopt_result.engine_info
    assert info["modelopt_version"] == version
    assert modelopt_result.engine.startswith(f"modelopt {version} (")


def test_same_layout_configs_and_unpacked_tensors(
    compared, builtin_dflash, modelopt_dflash, modelopt_engine
):
    source, builtin, modelopt = compared
    assert sorted(builtin) == sorted(modelopt)
    for name in builtin:
        assert (builtin[name].dtype, builtin[name].shape) == (
            modelopt[name].dtype,
            modelopt[name].shape,
        ), name
        if builtin[name].dtype == torch.bfloat16:  # stored BF16: the source tensor, unchanged
            assert bits_equal(builtin[name], source[name]) and bits_equal(
                modelopt[name], source[name]
            ), name
    _, version = modelopt_engine
    for file in ("config.json", "hf_quant_config.json"):
        a = json.loads((builtin_dflash / file).read_text())
        b = json.loads((modelopt_dflash / file).read_text())
        producer = (b.get("quantization_config") or b)["producer"]
        assert producer == {"name": "modelopt", "version": version}
        (a.get("quantization_config") or a)["producer"]["version"] = version
        assert a == b, file


def test_modelopt_excludes_the_same_modules(modelopt_result, builtin_dflash):
    """modelopt's own exclusion list (from the modules it left unquantized) selects the same
    modules as the layout's (tiny/drafts.exclude_modules)."""
    from vllm_nemotron_spec.checkpoint.spec import DraftSpec

    ours = DraftSpec.from_pretrained(builtin_dflash)
    cfg = json.loads((builtin_dflash / "config.json").read_text())
    cfg["quantization_config"] = modelopt_result.engine_info["modelopt_hf_quant_config"]
    theirs = DraftSpec.from_config(cfg)
    for name, _ in ours.linear_modules():
        assert ours.is_quantized(name) == theirs.is_quantized(name), name


def test_the_exact_difference(compared):
    source, builtin, modelopt = compared
    modules = sorted(k[: -len(".weight_scale")] for k in builtin if k.endswith(".weight_scale"))
    assert len(modules) == 19
    midpoints = _fp8_midpoints()
    blocks = scale_ties = weights = negative_zero = 0
    for m in modules:
        w = source[f"{m}.weight"].float()
        gs = builtin[f"{m}.weight_scale_2"]
        # global scales: identical
        assert bits_equal(gs, modelopt[f"{m}.weight_scale_2"]), m
        # block scales: modelopt's rule reproduces modelopt's bytes exactly ...
        s_b, s_m = builtin[f"{m}.weight_scale"], modelopt[f"{m}.weight_scale"]
        assert bits_equal(_modelopt_block_scales(w, gs), s_m), m
        # ... and they differ from builtin's only on fp8 rounding ties, by one fp8 step
        differ = s_b.view(torch.uint8) != s_m.view(torch.uint8)
        if differ.any():
            amax = w.reshape(w.shape[0], -1, nvfp4.GROUP_SIZE).abs().amax(-1).double()
            exact = amax[differ] / (6.0 * gs.double())
            distance = (exact[:, None] - midpoints).abs().min(-1).values / exact
            assert float(distance.max()) < 2.0**-23, m  # a tie, to fp32 precision
            steps = s_b.view(torch.uint8)[differ].int() - s_m.view(torch.uint8)[differ].int()
            assert int(steps.abs().max()) == 1, m
        blocks += differ.numel()
        scale_ties += int(differ.sum())
        # codes: in blocks with the same scale, equal up to the sign of zero
        same_block = (~differ).repeat_interleave(nvfp4.GROUP_SIZE, dim=1)
        c_b = nvfp4.unpack_codes(builtin[f"{m}.weight"])
        c_m = nvfp4.unpack_codes(modelopt[f"{m}.weight"])
        mismatch = (c_b != c_m) & same_block
        neg_zero = (c_b == 0) & (c_m == 8)
        assert bool((mismatch <= neg_zero).all()), m
        assert bool((w[mismatch] < 0).all()), m
        weights += w.numel()
        negative_zero += int(mismatch.sum())
        # dequantized values: equal wherever the block scales agree (-0.0 == 0.0)
        d_b = nvfp4.dequantize(builtin[f"{m}.weight"], s_b, gs)
        d_m = nvfp4.dequantize(modelopt[f"{m}.weight"], s_m, gs)
        assert torch.equal(d_b[same_block], d_m[same_block]), m
    # the measured numbers of the module doc (a change of either packer shows up here)
    assert (blocks, weights) == (61440, 983040)
    assert 0 < scale_ties <= blocks // 100, scale_ties
    assert 0 < negative_zero <= weights // 20, negative_zero


def test_in_process_in_the_modelopt_environment(
    modelopt_engine, bf16_dflash, modelopt_dflash, tmp_path
):
    """The command itself run by the modelopt environment's Python (no vLLM there): modelopt runs
    in-process, stdout stays one JSON object, and the bytes equal the worker's."""
    import subprocess

    from vllm_nemotron_spec.quantize import modelopt_engine as mo

    engine, version = modelopt_engine
    if engine.python is None:
        pytest.skip("modelopt imports in this Python: the in-process path is the fixture's own")
    out = tmp_path / "in-process"
    proc = subprocess.run(
        [
            str(engine.python),
            "-m",
            "vllm_nemotron_spec.cli.main",
            "quantize",
            str(bf16_dflash),
            str(out),
            "--engine",
            "modelopt",
            "--json",
        ],
        capture_output=True,
        text=True,
        env=mo._worker_env(),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["engine"] == f"modelopt {version} (in this process)"
    a, b = tensors(out), tensors(modelopt_dflash)
    assert sorted(a) == sorted(b) and all(bits_equal(a[k], b[k]) for k in a)


def test_dspark_draft_through_modelopt(modelopt_engine, bf16_dspark, tmp_path):
    """DSpark: modelopt packs markov_w2 too and keeps markov_w1 and the sinks BF16; global scales,
    BF16 tensors and configs equal builtin's."""
    from vllm_nemotron_spec.quantize.core import quantize_draft

    engine, version = modelopt_engine
    python = None if engine.python is None else str(engine.python)
    a = quantize_draft(bf16_dspark, tmp_path / "builtin", progress=False)
    b = quantize_draft(
        bf16_dspark, tmp_path / "modelopt", "modelopt", modelopt_python=python, progress=False
    )
    ta, tb = tensors(a.outdir), tensors(b.outdir)
    assert sorted(ta) == sorted(tb)
    assert tb["markov_head.markov_w2.weight"].dtype == torch.uint8
    assert tb["markov_head.markov_w1.weight"].dtype == torch.bfloat16
    assert tb["layers.0.self_attn.attention_sink_bias"].dtype == torch.bfloat16
    for k in ta:
        if k.endswith("weight_scale_2") or ta[k].dtype == torch.bfloat16:
            assert bits_equal(ta[k], tb[k]), k
    qa = json.loads((a.outdir / "config.json").read_text())["quantization_config"]
    qb = json.loads((b.outdir / "config.json").read_text())["quantization_config"]
    qa["producer"]["version"] = version
    assert qa == qb
