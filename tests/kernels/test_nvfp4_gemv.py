"""The few-row NVFP4 linear (vllm_nemotron_spec.kernels.nvfp4_gemv) against the float64
dequantization of vllm_nemotron_spec.nvfp4.format.

Without CUDA the kernel runs in Triton's interpreter, in a child pytest process
(tests/triton_interpreter.py); with CUDA on the GPU.

Bound: the kernel's products are exact (fp32 in the interpreter; on the GPU a bf16 weight with at
most 6 significant bits times a bf16 input), so its error is that of adding K products and the
split partials in fp32 plus one rounding for the row scale: (K + splits + 1) u sum_k |x_k W_nk|
with u = 2^-24; on the GPU the bf16 output adds half a bf16 ulp of |y| (2^-9 |y|). A wrong nibble
order or scale column errs by the size of the output itself, far above it (checked below).
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from tests import triton_interpreter as ti
from tests.nvfp4_bytes import raw_nvfp4
from vllm_nemotron_spec.nvfp4 import format as nvfp4

DEVICE = torch.device("cuda" if ti.CUDA else "cpu")

pytest.importorskip("triton")
gv = importlib.import_module("vllm_nemotron_spec.kernels.nvfp4_gemv")

U_FP32 = 2.0**-24


@ti.in_parent_only
def test_kernel_tests_in_triton_interpreter():
    ti.run_module_in_interpreter(__file__)


def raw_weight(n: int, k: int, seed: int):
    return raw_nvfp4(n, k, torch.Generator().manual_seed(seed))


def row_scales(n: int, shards: int = 2) -> torch.Tensor:
    """Fused shards' global scales: a ratio of 3 between neighbours (not a power of two)."""
    per_shard = [1e-3 * 3.0**s for s in range(shards)]
    return torch.tensor(per_shard).repeat_interleave(-(-n // shards))[:n].to(torch.float32)


def check(x, weight, scale, rows, cfg=None, swap_nibbles=False):
    """Run the kernel; assert the bound against float64; return (error, bound) maxima."""
    y = gv.nvfp4_gemv(x.to(DEVICE), weight.to(DEVICE), scale.to(DEVICE), rows.to(DEVICE), cfg)
    assert y.dtype == x.dtype and y.shape == (x.shape[0], weight.shape[0])
    packed = weight if not swap_nibbles else (weight >> 4) | (weight << 4)
    w = nvfp4.dequantize(packed, scale, 1.0, torch.float64) * rows.double()[:, None]
    ref = x.double() @ w.T
    k = x.shape[1]
    splits = (cfg or gv.GemvConfig(split_k=8)).split_k
    bound = (k + splits + 1) * U_FP32 * (x.double().abs() @ w.abs().T)
    if x.dtype != torch.float32:
        bound = bound + 2.0**-9 * ref.abs()
    err = (y.double().cpu() - ref).abs()
    return float(err.max()), float(bound.max()), bool((err <= bound).all())


@ti.kernel_test
@pytest.mark.parametrize(
    "n,k,m,cfg",
    [
        (40, 96, 3, gv.GemvConfig(block_n=16, block_k=32, split_k=2)),  # tails in N and K
        (64, 512, 1, gv.GemvConfig(block_n=32, block_k=128, split_k=4)),
        (33, 160, 16, gv.GemvConfig(block_n=16, block_k=64, split_k=3)),  # split not dividing
        (24, 64, 5, None),  # the default config
    ],
)
def test_every_code_and_scale_byte_within_the_fp32_bound(n, k, m, cfg):
    weight, scale = raw_weight(n, k, seed=n + k)
    g = torch.Generator().manual_seed(m)
    dtype = torch.bfloat16 if ti.CUDA else torch.float32
    x = torch.randn(m, k, generator=g).to(dtype)
    err, bound, ok = check(x, weight, scale, row_scales(n), cfg)
    assert ok, f"max error {err:.3e} over the bound (max {bound:.3e})"


@ti.kernel_test
def test_a_wrong_nibble_order_is_far_outside_the_bound():
    """The bound discriminates: the same output against the swapped-nibble dequantization."""
    n, k = 32, 128
    q = nvfp4.quantize(0.05 * torch.randn(n, k, generator=torch.Generator().manual_seed(1)))
    rows = torch.full((n,), float(q.weight_scale_2))
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(2))
    if ti.CUDA:
        x = x.to(torch.bfloat16)
    assert check(x, q.weight, q.weight_scale, rows)[2]
    err, bound, ok = check(x, q.weight, q.weight_scale, rows, swap_nibbles=True)
    assert not ok and err > 1000 * bound


def test_bad_inputs_name_what_was_expected():
    weight, scale = raw_weight(32, 64, seed=0)
    rows = row_scales(32)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match=r"expected \[M, 64\]"):
        gv.nvfp4_gemv(torch.randn(2, 48), weight, scale, rows)
    with pytest.raises(TypeError, match="weight_scale float8_e4m3fn"):
        gv.nvfp4_gemv(x, weight, scale.view(torch.uint8), rows)
    with pytest.raises(ValueError, match=r"weight_scale has shape \(32, 2\), expected \(32, 4\)"):
        gv.nvfp4_gemv(x, weight, scale[:, :2], rows)
    with pytest.raises(ValueError, match=r"row_scale must be fp32 \[32\]"):
        gv.nvfp4_gemv(x, weight, scale, rows[:16])
    with pytest.raises(ValueError, match="at most 16 rows, got 17"):
        gv.nvfp4_gemv(torch.randn(17, 64), weight, scale, rows)
    with pytest.raises(TypeError, match="bf16 or fp32 inputs, got torch.float16"):
        gv.nvfp4_gemv(x.half(), weight, scale, rows)


def test_default_config_splits_k_until_every_sm_has_programs():
    """The drafts' shapes on an H200 (132 SMs): K is split while the programs number fewer than
    four a SM and each split keeps at least four tiles."""
    assert gv.default_config(1, 2688, 16128, 132).split_k == 8  # fc: 42 row blocks
    assert gv.default_config(1, 12288, 2688, 132).split_k == 2  # gate_up: 192 row blocks
    assert gv.default_config(1, 131072, 512, 132).split_k == 1  # markov_w2
    assert gv.default_config(1, 2688, 6144, 132).split_k == 4  # down: K / 4 = 6 tiles


@pytest.mark.skipif(
    not ti.nvidia_backend(), reason="needs Triton's NVIDIA backend (not interpreted)"
)
def test_default_config_builds_for_sm90_without_spills():
    """The default launch shape compiles for the H200 (sm_90) with this Triton (offline: no GPU
    needed) and keeps its tile in registers: no local-memory stack."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cfg = gv.default_config(1, 12288, 2688, 132)
    fn = gv._nvfp4_gemv_kernel
    names = fn.arg_names
    const = dict(BLOCK_M=16, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_MODE=1, NATIVE_FP8=True)
    types = {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*u8", "g_ptr": "*fp32", "out_ptr": "*bf16"}
    signature = {n: ("constexpr" if n in const else types.get(n, "i32")) for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n.endswith("_ptr")}
    src = ASTSource(
        fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in const.items()},
        attrs=attrs,
    )  # fmt: skip
    opts = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    cuobjdump = Path(sys.modules["triton"].__file__).parent / "backends/nvidia/bin/cuobjdump"
    if not cuobjdump.exists():
        pytest.skip("no cuobjdump beside Triton to read the register use")
    cubin = Path(os.environ.get("TMPDIR", "/tmp")) / f"nvfp4_gemv_sm90_{os.getpid()}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    usage = subprocess.run(
        [str(cuobjdump), "-res-usage", str(cubin)], capture_output=True, text=True
    )
    cubin.unlink()
    assert int(re.search(r"STACK:(\d+)", usage.stdout).group(1)) == 0, usage.stdout
