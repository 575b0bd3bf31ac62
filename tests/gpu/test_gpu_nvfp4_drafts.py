"""The quantized drafts on the GPU's own kernels, bf16, model runner V2.

- ``dspark_nvfp4``: the trained DSpark draft in the official W4A16 NVFP4 layout. Its linears run
  the plugin's ``NvFp4KernelLinearMethod`` on the kernel vLLM picks (Humming on Hopper when
  installed, FP4 Marlin else), and ``DSparkSpeculator`` hands each greedy step to the plugin's
  fused Markov walk (``sample_sequential``) where it is on (one Hopper GPU), else to vLLM's loop.
- ``dflash_ct``: the trained DFlash draft quantized NVFP4A16 by the compressed-tensors library, on
  vLLM's own compressed-tensors scheme and kernel (the plugin claims it for the Nemotron module
  names only).

Both must be accepted as trained (what a wrong kernel, scale or walk could not reach: those
collapse to about one token) and part from plain bf16 decoding only where plain decoding's two
best logits are within a few bf16 units (exactness itself is asserted in fp32,
test_gpu_spec_decode.py: the NVFP4 kernels take 16-bit activations only).
"""

from __future__ import annotations

import pytest

from tests.gpu.checks import W4A16_KERNELS, divergences, expected_w4a16_kernel
from tests.gpu.engines import NUM_DFLASH_TOKENS, NUM_DSPARK_TOKENS, V2_RUNNER

MIN_MEAN_ACCEPTANCE_LENGTH = 2.5  # as test_gpu_spec_decode.py and the CPU engine tests

RUNS = {
    # run: (speculator, the plugin's draft class, draft quantization, drafted tokens)
    "dspark_nvfp4": (
        "DSparkSpeculator",
        "Nemotron35DSparkForCausalLM",
        "nemotron_w4a16_nvfp4",
        NUM_DSPARK_TOKENS,
    ),
    "dflash_ct": (
        "DFlashSpeculator",
        "Nemotron35DFlashForCausalLM",
        "nemotron_ct_w4a16_nvfp4",
        NUM_DFLASH_TOKENS,
    ),
}


def _assert_vllms_w4a16_kernel(kernel: str | None, gpu_session) -> None:
    """The kernel vLLM picks on this device where that is known, else one of its W4A16 kernels."""
    from vllm.utils.import_utils import has_humming

    expected = expected_w4a16_kernel(gpu_session["capability"], has_humming())
    if expected is not None:
        assert kernel == expected, f"NVFP4 kernel {kernel}, expected {expected}"
    else:
        assert kernel in W4A16_KERNELS, f"NVFP4 kernel {kernel}, not one of {sorted(W4A16_KERNELS)}"


@pytest.mark.parametrize("name", list(RUNS))
def test_quantized_draft_is_routed_under_v2(bf16_runs, name):
    speculator, draft_class, quantization, _ = RUNS[name]
    facts = bf16_runs[name].facts
    assert (facts.runner, facts.speculator, facts.draft_model, facts.draft_quantization) == (
        V2_RUNNER,
        speculator,
        draft_class,
        quantization,
    )


def test_nvfp4_draft_runs_the_plugins_method_on_vllms_kernel(bf16_runs, gpu_session):
    kernels = bf16_runs["dspark_nvfp4"].facts.draft_linear_kernels
    assert len(kernels) == 1, kernels
    method, scheme, kernel = next(iter(kernels))
    assert (method, scheme) == ("NvFp4KernelLinearMethod", None), kernels
    _assert_vllms_w4a16_kernel(kernel, gpu_session)


def test_compressed_tensors_draft_runs_vllms_scheme(bf16_runs, gpu_session):
    kernels = bf16_runs["dflash_ct"].facts.draft_linear_kernels
    assert len(kernels) == 1, kernels
    method, scheme, kernel = next(iter(kernels))
    assert (method, scheme) == ("CompressedTensorsLinearMethod", "CompressedTensorsW4A4Fp4"), (
        kernels
    )
    _assert_vllms_w4a16_kernel(kernel, gpu_session)


def test_dspark_speculator_runs_the_walk_the_plugin_chose(bf16_runs, gpu_session):
    """On one Hopper GPU the fused greedy walk drafts every step (the hook returns True); on
    other GPUs vLLM's loop, with the reason logged."""
    from vllm_nemotron_spec.models.nemotron35_dspark import fused_walk_switch_reason

    expected = fused_walk_switch_reason(1, gpu_session["capability"])
    choices = bf16_runs["dspark_nvfp4"].extra["walk_choices"]
    assert choices == {expected}, f"walk choices {choices}, expected {{{expected!r}}}"


@pytest.mark.parametrize("name", list(RUNS))
def test_quantized_draft_is_accepted(bf16_runs, name):
    c = bf16_runs[name].counters
    k = RUNS[name][3]
    assert c.num_drafts > 0 and len(c.accepted_per_position) == k
    assert c.mean_acceptance_length >= MIN_MEAN_ACCEPTANCE_LENGTH, (
        f"{name}: mean acceptance length {c.mean_acceptance_length:.3f} at {k} drafted tokens "
        f"(per position {[round(r, 3) for r in c.per_position_acceptance]})"
    )


@pytest.mark.parametrize("name", list(RUNS))
def test_outputs_part_from_plain_bf16_only_at_near_ties(bf16_runs, name):
    plain = bf16_runs["plain"]
    found = divergences(plain.tokens, plain.top2, bf16_runs[name].tokens)
    not_ties = [d for d in found if not d.at_near_tie]
    assert not not_ties, f"{name} parts from plain bf16 decoding away from a near-tie: {not_ties}"
