"""Pure helpers of the GPU tests: error bounds, token comparisons, what to expect of vLLM's
choices on a device, the summary line. No vLLM import, no device access: they are unit-tested
on CPU (tests/test_gpu_checks.py).
"""

from __future__ import annotations

import math
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass

# ------------------------------------------------------------------------------------------------
# NVFP4 W4A16 GEMM error bound
# ------------------------------------------------------------------------------------------------

U_BF16 = 2.0**-8
"""Unit roundoff of bf16 (8 significant bits, round to nearest): |bf16(v) - v| <= U_BF16 |v|."""

U_ACC = 2.0**-23
"""One fp32 ulp relative: the error of one fp32 accumulation step, allowing accumulators that
truncate instead of rounding (tensor cores may)."""

OUTPUT_ROUNDINGS = 3
"""bf16 roundings an output may take after the fp32 sum: the accumulator's conversion, a global
scale held in bf16, their product."""

HUMMING_MAX_SLICES = 10
"""humming-kernels 0.1.19 splits one output tile's K into at most 10 stream-K slices
(``kMaxSlices``, include/humming/scheduler.cuh), and only where K > 1024 (tune/base.py)."""

BF16_SLICE_KERNELS = {"HummingNvFp4LinearKernel": (HUMMING_MAX_SLICES, 1024)}
"""Kernels that round each stream-K slice's partial sum to bf16 and add the slices in bf16
(humming 0.1.19, epilogue/gmem_writer.cuh: bf16 store, then bf16 reduce-add): name -> (most
slices per output, the K above which it splits)."""


def bf16_slices(kernel: str, k: int) -> int:
    """How many bf16-rounded partial sums ``kernel`` may add for an output with ``k`` inputs (0:
    it reduces in fp32)."""
    most, above = BF16_SLICE_KERNELS.get(kernel, (0, 0))
    return most if k > above else 0


def nvfp4_gemm_error_bound(y_ref, abs_sum, k: int, prefix_max=None, slices: int = 0):
    """Elementwise bound on ``|y - y_ref|`` for a W4A16 NVFP4 GEMM ``y = bf16(x @ W^T)``.

    ``y_ref`` is the exact product (fp64) of the bf16 input and the reference dequantized weight
    (``nvfp4/format.py``); ``abs_sum`` is ``|x| @ |W|^T``; ``prefix_max`` the largest magnitude of
    a partial sum of the dot product over the first K inputs at any multiple of 16 (only read when
    ``slices``). The arithmetic:

    - the products are exact: an E2M1 code times its fp8 block scale has at most 6 significant
      bits, so it is a bf16 number, and bf16 x bf16 fits fp32;
    - summing ``k`` products and applying the global scale in fp32, in any order, with one fp32
      ulp per step: at most ``(k + 1) * U_ACC * abs_sum`` (the standard summation bound);
    - the output: at most ``OUTPUT_ROUNDINGS`` bf16 roundings, ``3 * U_BF16 * |y_ref|``;
    - a kernel that rounds each of ``slices`` partial sums to bf16 and adds them in bf16: each
      slice's partial and each running sum rounded once, every partial at most
      ``2 * prefix_max``, every running sum at most ``prefix_max``:
      ``(3 * slices - 1) * U_BF16 * prefix_max``.

    A wrong nibble order, a shard with the wrong global scale or another row's weights err by
    about ``|y_ref|`` or more, orders of magnitude above this bound at the draft shapes."""
    bound = OUTPUT_ROUNDINGS * U_BF16 * y_ref.abs() + (k + 1) * U_ACC * abs_sum
    if slices:
        if prefix_max is None:
            raise ValueError(f"a kernel adding {slices} bf16 partial sums needs prefix_max")
        bound = bound + (3 * slices - 1) * U_BF16 * prefix_max
    return bound


def prefix_max_abs(x, weight, group: int = 16, rows_per_chunk: int = 8):
    """``max_b |sum_{k < b} x[m, k] * weight[n, k]|`` over ``b`` in multiples of ``group``, fp64,
    shape ``[M, N]`` (the partial sums a kernel splitting K on tile boundaries can hold)."""
    import torch

    m, k = x.shape
    if k % group or weight.shape[1] != k:
        raise ValueError(
            f"x {tuple(x.shape)} and weight {tuple(weight.shape)}: expected the same K, a "
            f"multiple of {group}"
        )
    w = weight.double().view(weight.shape[0], k // group, group)
    out = []
    for start in range(0, m, rows_per_chunk):
        xs = x[start : start + rows_per_chunk].double().view(-1, k // group, group)
        partial = torch.einsum("mbg,nbg->mnb", xs, w).cumsum(-1)
        out.append(partial.abs().amax(-1))
    return torch.cat(out)


def worst_excess(error, bound) -> tuple[float, tuple[int, ...]]:
    """(largest ``error / bound``, its index): above 1 means the bound is broken there."""
    ratio = error / bound
    flat = int(ratio.argmax())
    index = tuple(int(i) for i in _unravel(flat, tuple(ratio.shape)))
    return float(ratio.reshape(-1)[flat]), index


def _unravel(flat: int, shape: tuple[int, ...]) -> list[int]:
    out = []
    for size in reversed(shape):
        out.append(flat % size)
        flat //= size
    return list(reversed(out))


# ------------------------------------------------------------------------------------------------
# Greedy tokens against plain decoding
# ------------------------------------------------------------------------------------------------


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (a length difference counts), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def differing_prompts(expected: list[list[int]], got: list[list[int]]) -> list[tuple[int, int]]:
    """(prompt index, first differing position) of every output that differs."""
    if len(expected) != len(got):
        raise ValueError(f"{len(got)} outputs to compare with {len(expected)} expected ones")
    out = []
    for i, (a, b) in enumerate(zip(expected, got)):
        pos = first_difference(a, b)
        if pos is not None:
            out.append((i, pos))
    return out


def bf16_ulp(value: float) -> float:
    """The spacing of bf16 numbers at ``value`` (8 significant bits)."""
    magnitude = abs(value)
    if magnitude < 2.0**-126:  # subnormal range: the smallest spacing
        return 2.0**-133
    return 2.0 ** (math.floor(math.log2(magnitude)) - 7)


NEAR_TIE_BF16_UNITS = 4
"""Two logits closer than this many bf16 units of the larger one may come out in either order
between two bf16 runs of the same target: each run's logits are the bf16 output (half a unit) of
a GEMM whose bf16 input (the final norm's output) carries another rounding, and speculative
decoding computes them at other batch shapes than plain decoding. A wrong Mamba state, KV slot or
verification parts from plain decoding at any position, not only at near-ties."""


@dataclass(frozen=True)
class Divergence:
    prompt: int
    position: int
    got: int
    top2: tuple[tuple[int, float], ...]
    """Plain decoding's two largest logits at ``position``: (token, logit), largest first."""

    @property
    def at_near_tie(self) -> bool:
        """Whether plain decoding's runner-up was emitted where the two logits are within
        :data:`NEAR_TIE_BF16_UNITS` bf16 units of each other."""
        if len(self.top2) < 2:
            return False
        (_, first), (second_token, second) = self.top2[0], self.top2[1]
        return self.got == second_token and first - second <= NEAR_TIE_BF16_UNITS * bf16_ulp(first)


def divergences(plain, plain_top2, got) -> list[Divergence]:
    """Where ``got`` parts from plain decoding, with plain's top two logits there.

    ``plain_top2[i][j]`` lists (token, logit) of prompt i's output position j (vLLM's logprobs
    of a ``logprobs_mode="raw_logits"`` engine)."""
    out = []
    for i, pos in differing_prompts(plain, got):
        if pos >= len(plain[i]) or pos >= len(got[i]):
            out.append(Divergence(i, pos, -1, ()))  # a length difference: never a near-tie
            continue
        top2 = tuple(sorted(plain_top2[i][pos], key=lambda t: -t[1])[:2])
        out.append(Divergence(i, pos, got[i][pos], top2))
    return out


# ------------------------------------------------------------------------------------------------
# vLLM's choices on a device
# ------------------------------------------------------------------------------------------------

W4A16_KERNELS = frozenset(
    {
        "HummingNvFp4LinearKernel",
        "MarlinNvFp4LinearKernel",
        "FlashInferCuteDslNvFp4W4A16LinearKernel",
        "B12xNvFp4W4A16LinearKernel",
    }
)
"""vLLM 0.33's NVFP4 weight-only kernels (``init_nvfp4_linear_kernel(use_a16=True)``)."""


def expected_w4a16_kernel(capability: tuple[int, int], humming_installed: bool) -> str | None:
    """The NVFP4 W4A16 kernel vLLM 0.33 picks with its defaults, where that is known: on Hopper
    Humming when installed, else FP4 Marlin (``init_nvfp4_linear_kernel``, ``prefers_humming``:
    SM90 only). None elsewhere (any of :data:`W4A16_KERNELS`)."""
    if tuple(capability) == (9, 0):
        return "HummingNvFp4LinearKernel" if humming_installed else "MarlinNvFp4LinearKernel"
    return None


def expected_attention(
    pinned: str | None, capability: tuple[int, int], dtype: str
) -> tuple[str, int | None] | None:
    """(backend, FlashAttention version or None) one side of the engine must run: the plugin's
    pin where it set one; vLLM's default where that is known (Hopper, 16-bit: FLASH_ATTN with FA3,
    first in vLLM 0.33's ``_get_backend_priorities`` for causal and non-causal layers, sinks and
    sliding windows included); None where neither says (record only)."""
    if pinned is not None:
        return pinned, None
    if capability[0] == 9 and dtype in ("bfloat16", "float16"):
        return "FLASH_ATTN", 3
    return None


# ------------------------------------------------------------------------------------------------
# The run's summary line
# ------------------------------------------------------------------------------------------------


def junit_counts(xml_text: str) -> dict[str, float]:
    """tests, failures, errors, skipped and time summed over a JUnit XML report's test suites."""
    root = ET.fromstring(xml_text)
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    keys = ("tests", "failures", "errors", "skipped")
    counts: dict[str, float] = {key: 0 for key in keys}
    counts["time"] = 0.0
    for suite in suites:
        for key in keys:
            counts[key] += int(suite.get(key, 0))
        counts["time"] += float(suite.get("time", 0.0))
    return counts


def summary_line(
    xml_text: str, *, date: str, commit: str, device: str, stopped: bool = False
) -> str:
    """One line: verdict, counts, time, date, commit, device (what the docs record). A run
    ``stopped`` at its deadline is INCOMPLETE unless something already failed: what it did not
    reach was not checked."""
    c = junit_counts(xml_text)
    passed = int(c["tests"] - c["failures"] - c["errors"] - c["skipped"])
    ok = c["failures"] == 0 and c["errors"] == 0 and passed > 0
    verdict = "PASS" if ok else "FAIL"
    if ok and stopped:
        verdict = "INCOMPLETE (stopped at the deadline)"
    return (
        f"GPU TESTS {verdict}: {passed} passed, {int(c['failures'])} failed, "
        f"{int(c['errors'])} errors, {int(c['skipped'])} skipped in {c['time']:.0f} s; "
        f"{date}; commit {commit}; {device}"
    )


def main(argv: list[str]) -> int:
    """``python3 -m tests.gpu.checks JUNIT_XML COMMIT [PYTEST_EXIT]``: print the summary line
    (date in UTC, the CUDA device's name); exit status 124 (``timeout``'s) or 2 (pytest
    interrupted) marks a run stopped at its deadline."""
    import time
    from pathlib import Path

    if len(argv) not in (2, 3):
        print("usage: python3 -m tests.gpu.checks JUNIT_XML COMMIT [PYTEST_EXIT]", file=sys.stderr)
        return 2
    xml_path, commit = argv[:2]
    stopped = len(argv) == 3 and argv[2] in ("124", "2")
    try:
        import torch

        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    except Exception as exc:  # noqa: BLE001 - the line must still be printed
        device = f"device unknown ({type(exc).__name__})"
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    line = summary_line(
        Path(xml_path).read_text(), date=date, commit=commit, device=device, stopped=stopped
    )
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
