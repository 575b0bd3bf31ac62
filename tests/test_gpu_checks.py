"""The GPU tests' pure helpers (tests/gpu/checks.py) on CPU, and their clean skip without CUDA.

The NVFP4 error bound is checked against emulations of the two kernel arithmetics it covers
(fp32 accumulation in 16-wide steps, bf16 output; stream-K slices rounded and added in bf16) and
against the mistakes it must catch (a wrong nibble order, a shard with the wrong global scale).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.gpu import checks
from vllm_nemotron_spec.nvfp4 import format as nvfp4

REPO = Path(__file__).resolve().parents[1]
K, N, M = 2688, 96, 4


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.02
    w[0, :8] *= 8
    q = nvfp4.quantize(w)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    exact_w = nvfp4.dequantize(q.weight, q.weight_scale, 1.0).double() * float(q.weight_scale_2)
    return q, x, exact_w


def _reference(x, w):
    xd = x.double()
    return xd @ w.T, xd.abs() @ w.abs().T


def _fp32_kernel(x, w, k0: int = 0, k1: int = K):
    """fp32 sums of 16 products at a time over [k0, k1) (a tensor-core GEMM's order)."""
    acc = torch.zeros(x.shape[0], w.shape[0])
    xf, wf = x.float(), w.float()
    for k in range(k0, k1, 16):
        acc = acc + xf[:, k : k + 16] @ wf[:, k : k + 16].T
    return acc


def test_bound_holds_for_fp32_accumulation_and_a_bf16_output():
    _, x, w = _case()
    y_ref, abs_sum = _reference(x, w)
    y = _fp32_kernel(x, w).to(torch.bfloat16).double()
    bound = checks.nvfp4_gemm_error_bound(y_ref, abs_sum, K)
    excess, _ = checks.worst_excess((y - y_ref).abs(), bound)
    assert excess <= 1


@pytest.mark.parametrize("slices", [2, 5, 10])
def test_bound_holds_for_stream_k_slices_added_in_bf16(slices):
    _, x, w = _case(1)
    y_ref, abs_sum = _reference(x, w)
    edges = [round(K // 16 * j / slices) * 16 for j in range(slices + 1)]
    out = torch.zeros(M, N, dtype=torch.bfloat16)
    for k0, k1 in zip(edges, edges[1:]):  # each slice's partial rounded, then added in bf16
        out = (out.float() + _fp32_kernel(x, w, k0, k1).to(torch.bfloat16).float()).to(
            torch.bfloat16
        )
    prefix = checks.prefix_max_abs(x, w)
    bound = checks.nvfp4_gemm_error_bound(y_ref, abs_sum, K, prefix, slices)
    excess, _ = checks.worst_excess((out.double() - y_ref).abs(), bound)
    assert excess <= 1


def test_bound_catches_a_wrong_nibble_order_and_a_wrong_global_scale():
    q, x, w = _case(2)
    y_ref, abs_sum = _reference(x, w)
    bound = checks.nvfp4_gemm_error_bound(y_ref, abs_sum, K, checks.prefix_max_abs(x, w), 10)
    swapped = ((q.weight & 0x0F) << 4) | (q.weight >> 4)
    w_swapped = nvfp4.dequantize(swapped, q.weight_scale, q.weight_scale_2).double()
    for wrong in (x.double() @ w_swapped.T, y_ref * 3, y_ref / 3):
        excess, _ = checks.worst_excess((wrong - y_ref).abs(), bound)
        assert excess > 4  # measured 36, 15 and 5 with the bf16-slice term; 215, 126, 42 without


def test_a_bf16_slice_kernel_needs_its_prefix_sums():
    y = torch.ones(1, 1, dtype=torch.float64)
    with pytest.raises(ValueError, match="needs prefix_max"):
        checks.nvfp4_gemm_error_bound(y, y, 16, None, 10)


def test_prefix_max_abs_is_the_largest_partial_sum_at_group_boundaries():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(3, 64, generator=g), torch.randn(5, 64, generator=g)
    got = checks.prefix_max_abs(x, w, group=16, rows_per_chunk=2)
    products = x.double()[:, None, :] * w.double()[None, :, :]
    prefixes = torch.stack([products[..., :b].sum(-1) for b in (16, 32, 48, 64)], dim=-1)
    assert torch.allclose(got, prefixes.abs().amax(-1), rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="multiple of 16"):
        checks.prefix_max_abs(x[:, :60], w[:, :60])


def test_bf16_slices_per_kernel():
    assert checks.bf16_slices("HummingNvFp4LinearKernel", 2688) == checks.HUMMING_MAX_SLICES
    assert checks.bf16_slices("HummingNvFp4LinearKernel", 512) == 0  # no stream-K at K <= 1024
    assert checks.bf16_slices("MarlinNvFp4LinearKernel", 16128) == 0


def test_worst_excess_names_the_element():
    error = torch.tensor([[0.1, 0.5], [3.0, 0.2]])
    bound = torch.tensor([[1.0, 1.0], [2.0, 1.0]])
    assert checks.worst_excess(error, bound) == (1.5, (1, 0))


def test_first_difference_and_differing_prompts():
    assert checks.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert checks.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert checks.first_difference([1, 2], [1, 2, 3]) == 2
    assert checks.differing_prompts([[1, 2], [3, 4], [5]], [[1, 2], [3, 9], [6]]) == [
        (1, 1),
        (2, 0),
    ]
    with pytest.raises(ValueError, match="2 outputs to compare with 3"):
        checks.differing_prompts([[1], [2], [3]], [[1], [2]])


@pytest.mark.parametrize("value, ulp", [(1.0, 2**-7), (3.0, 2**-6), (-0.75, 2**-8), (16.5, 2**-3)])
def test_bf16_ulp(value, ulp):
    assert checks.bf16_ulp(value) == ulp


def test_a_divergence_is_a_near_tie_only_for_plain_decodings_close_runner_up():
    units = checks.NEAR_TIE_BF16_UNITS
    top = 10.0  # one bf16 unit is 2**-4 here
    close = ((7, top), (9, top - units * 2**-4))
    far = ((7, top), (9, top - (units + 1) * 2**-4))
    assert checks.Divergence(0, 3, got=9, top2=close).at_near_tie
    assert not checks.Divergence(0, 3, got=9, top2=far).at_near_tie
    assert not checks.Divergence(0, 3, got=8, top2=close).at_near_tie  # not the runner-up
    assert not checks.Divergence(0, 3, got=9, top2=()).at_near_tie


def test_divergences_read_plain_decodings_top_two_at_the_first_difference():
    plain = [[1, 2, 3], [4, 5, 6]]
    top2 = [
        [[(1, 9.0), (0, 1.0)], [(2, 5.0), (8, 4.99)], [(3, 1.0), (0, 0.5)]],
        [[(4, 9.0), (0, 1.0)], [(5, 9.0), (0, 1.0)], [(6, 9.0), (0, 1.0)]],
    ]
    found = checks.divergences(plain, top2, [[1, 8, 0], [4, 5, 6]])
    assert found == [checks.Divergence(0, 1, 8, ((2, 5.0), (8, 4.99)))]
    assert found[0].at_near_tie
    (short,) = checks.divergences(plain, top2, [[1, 2, 3], [4, 5]])
    assert (short.prompt, short.position, short.at_near_tie) == (1, 2, False)


def test_expected_kernel_and_attention_on_hopper_and_elsewhere():
    assert checks.expected_w4a16_kernel((9, 0), True) == "HummingNvFp4LinearKernel"
    assert checks.expected_w4a16_kernel((9, 0), False) == "MarlinNvFp4LinearKernel"
    assert checks.expected_w4a16_kernel((10, 0), True) is None
    assert checks.expected_attention("FLASHINFER", (10, 0), "bfloat16") == ("FLASHINFER", None)
    assert checks.expected_attention(None, (9, 0), "bfloat16") == ("FLASH_ATTN", 3)
    assert checks.expected_attention(None, (9, 0), "float32") is None  # FA takes 16-bit only
    assert checks.expected_attention(None, (12, 0), "bfloat16") is None


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests">
<testsuite name="gpu-tests" errors="{e}" failures="{f}" skipped="{s}" tests="{t}" time="251.7"
 timestamp="2026-12-06T10:00:00" hostname="h200"><testcase classname="x" name="y"/></testsuite>
</testsuites>"""


def test_summary_line_says_verdict_counts_date_commit_device():
    line = checks.summary_line(
        JUNIT.format(e=0, f=0, s=1, t=31), date="2026-12-06 10:04 UTC", commit="abc1234", device="H"
    )
    assert line == (
        "GPU TESTS PASS: 30 passed, 0 failed, 0 errors, 1 skipped in 252 s; "
        "2026-12-06 10:04 UTC; commit abc1234; H"
    )
    assert checks.summary_line(JUNIT.format(e=1, f=0, s=0, t=31), date="d", commit="c", device="H")
    failed = checks.summary_line(JUNIT.format(e=0, f=2, s=0, t=31), date="d", commit="c", device="")
    assert failed.startswith("GPU TESTS FAIL: 29 passed, 2 failed")
    skipped = checks.summary_line(
        JUNIT.format(e=0, f=0, s=31, t=31), date="d", commit="c", device=""
    )
    assert skipped.startswith("GPU TESTS FAIL: 0 passed")  # nothing ran: not a pass
    stopped = checks.summary_line(
        JUNIT.format(e=0, f=0, s=0, t=31), date="d", commit="c", device="", stopped=True
    )
    assert stopped.startswith("GPU TESTS INCOMPLETE (stopped at the deadline): 31 passed")
    stopped_failed = checks.summary_line(
        JUNIT.format(e=0, f=1, s=0, t=31), date="d", commit="c", device="", stopped=True
    )
    assert stopped_failed.startswith("GPU TESTS FAIL: 30 passed, 1 failed")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the run without a CUDA GPU")
def test_gpu_tests_skip_cleanly_without_cuda_and_import_no_vllm():
    """``pytest tests/gpu`` on a machine without CUDA: every test marked ``gpu`` and skipped with
    the stated reason, nothing failed, and vLLM never imported (collection stays cheap)."""
    script = textwrap.dedent(
        """
        import sys, pytest
        rc = pytest.main(["-q", "-rs", "-p", "no:cacheprovider", "-m", "gpu", "tests/gpu"])
        print("EXIT", int(rc))
        print("VLLM_IMPORTED", any(m == "vllm" or m.startswith("vllm.") for m in sys.modules))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    text = out.stdout + out.stderr
    assert "EXIT 0" in text, text[-3000:]
    assert "VLLM_IMPORTED False" in text, text[-3000:]
    assert "needs a CUDA GPU (torch.cuda.is_available() is False)" in text, text[-3000:]
    assert " skipped" in text and " passed" not in text and " failed" not in text, text[-3000:]


@pytest.mark.parametrize("writes_report", [False, True])
def test_gpu_tests_script_stopped_at_its_deadline_says_incomplete(tmp_path, writes_report):
    """scripts/gpu-tests.sh whose pytest is stopped by the deadline: INCOMPLETE (with or without
    a JUnit report written on the interrupt), never PASS, and the exit status is not 0."""
    report = tmp_path / "report.xml"
    report.write_text(JUNIT.format(e=0, f=0, s=0, t=1))
    on_interrupt = f'cp {report} "$xml"; ' if writes_report else ""
    fake_python = tmp_path / "python"
    fake_python.write_text(
        textwrap.dedent(
            f"""\
            #!/usr/bin/env bash
            [ "$2" = pip ] && exit 0
            for a in "$@"; do case "$a" in --junitxml=*) xml="${{a#--junitxml=}}";; esac; done
            if [ "$2" = pytest ]; then
              sleep 30 > /dev/null &
              trap 'kill $!; {on_interrupt}exit 2' INT
              wait
              exit 0
            fi
            exec {sys.executable} "$@"
            """
        )
    )
    fake_python.chmod(0o755)
    out = subprocess.run(
        ["bash", "scripts/gpu-tests.sh", str(tmp_path / "out"), "tests/gpu/test_gpu_attention.py"],
        cwd=REPO,
        env={
            "PATH": "/usr/bin:/bin",
            "PYTHON": str(fake_python),
            "GPU_TESTS_TIMEOUT": "1",
            "GPU_TESTS_COMMIT": "abc1234",
            "HOME": str(tmp_path),
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    summary = (tmp_path / "out" / "gpu-tests-summary.txt").read_text()
    assert summary.startswith("GPU TESTS INCOMPLETE (stopped at the deadline"), summary
    assert "commit abc1234" in summary
    assert out.returncode != 0
