"""NVFP4 W4A16 linear layers on the GPU's kernels against the reference dequantization.

Each case is a real vLLM layer at a Nemotron 3.5 draft shape, built with the plugin's quantization
config and loaded through its weight loaders from ModelOpt tensors (``nvfp4/format.py``'s
``quantize`` of Gaussian weights with a few outliers). On GPU its ``NvFp4KernelLinearMethod``
runs the W4A16 kernel vLLM picks (Humming on Hopper when installed, FP4 Marlin else); fused
shards with different ``weight_scale_2`` are folded into one GEMM where a power-of-two ratio makes
that exact, else run as one GEMM per shard. Every output element must be within the bound of
``tests/gpu/checks.py: nvfp4_gemm_error_bound`` (bf16 input and output, fp32 accumulation) of the
exact product with the reference dequantized weight.
"""

from __future__ import annotations

import pytest

from benchmarks.harness.nvfp4_layers import (
    CASES,
    QUANT_CONFIG,
    build_layer,
    init_vllm,
    load,
    make_shards,
    nvfp4_tensors,
)
from tests.gpu.checks import (
    bf16_slices,
    expected_w4a16_kernel,
    nvfp4_gemm_error_bound,
    prefix_max_abs,
    worst_excess,
)

MS = (1, 4, 16, 64)


def _shards(case: str):
    """ModelOpt NVFP4 tensors of each shard (fused cases: gate, up), on the GPU."""
    return make_shards(case, "cuda")


def _layer(case: str, quant_config, shards):
    """The vLLM layer of ``case``, its tensors loaded through the weight loaders, processed."""
    import torch

    with torch.device("cuda"):
        layer = build_layer(case, quant_config, torch.bfloat16)
        return load(layer, case, [nvfp4_tensors(q) for q in shards])


@pytest.fixture(scope="module")
def quant_config():
    """The plugin's W4A16 NVFP4 config, with vLLM's distributed state (world size 1) and a
    current VllmConfig while the module's layers are built (torn down after, if made here)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    from vllm_nemotron_spec.nvfp4 import config as nvcfg

    with set_current_vllm_config(VllmConfig()):
        created = init_vllm("cuda")
        try:
            nvcfg.register()
            yield nvcfg.NemotronW4A16NvFp4Config.from_config(QUANT_CONFIG)
        finally:
            if created:
                ps.destroy_model_parallel()
                ps.destroy_distributed_environment()


def _exact(x, shards):
    """Per shard: the exact product with the reference weight, |x| @ |W|^T, and the weight.

    The block-scaled codes (E2M1 x fp8 scale) are exact in fp32; the global scale is applied in
    fp64, so the reference carries no rounding of its own."""
    from vllm_nemotron_spec.nvfp4 import format as nvfp4

    xd = x.double()
    out = []
    for q in shards:
        w = nvfp4.dequantize(q.weight, q.weight_scale, 1.0).double() * float(q.weight_scale_2)
        out.append((xd @ w.T, xd.abs() @ w.abs().T, w))
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_nvfp4_gemm_within_the_arithmetic_bound(quant_config, gpu_session, case):
    import torch
    from vllm.utils.import_utils import has_humming

    shards = _shards(case)
    layer = _layer(case, quant_config, shards)
    method = layer.quant_method
    kernel = type(method.kernel).__name__
    expected_kernel = expected_w4a16_kernel(gpu_session["capability"], has_humming())
    assert expected_kernel in (None, kernel), f"kernel {kernel}, expected {expected_kernel}"
    split = CASES[case][3] not in (None, 1.0, 4.0)
    assert (method.shard_kernels is not None) == split, (
        f"{case}: {'one GEMM per shard' if method.shard_kernels else 'one GEMM'}, expected "
        f"{'one GEMM per shard' if split else 'one GEMM'}"
    )
    _, k, outs, _ = CASES[case]
    slices = bf16_slices(kernel, k)
    failures = []
    for m in MS:
        g = torch.Generator(device="cuda").manual_seed(m)
        x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        y = method.apply(layer, x)[..., : sum(outs)]  # lm_head: padding rows after the vocab
        assert y.dtype == torch.bfloat16 and bool(torch.isfinite(y).all())
        parts = _exact(x, shards)
        y_ref = torch.cat([p[0] for p in parts], dim=-1)
        abs_sum = torch.cat([p[1] for p in parts], dim=-1)
        prefix = None
        if slices:
            prefix = torch.cat([prefix_max_abs(x, p[2]) for p in parts], dim=-1)
        bound = nvfp4_gemm_error_bound(y_ref, abs_sum, k, prefix, slices)
        excess, (row, col) = worst_excess((y.double() - y_ref).abs(), bound)
        if excess > 1:
            failures.append(
                f"M={m}: output [{row}, {col}] = {float(y[row, col]):.6g}, exact "
                f"{float(y_ref[row, col]):.6g}, error {excess:.3g} x the bound "
                f"{float(bound[row, col]):.3g}"
            )
    assert not failures, f"{case} on {kernel}: " + "; ".join(failures)
