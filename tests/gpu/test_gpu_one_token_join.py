"""A one-token prompt joining a decoding batch on a hybrid (Mamba) target, vLLM 0.33 on GPU.

vLLM's scheduler pads a request with one token to schedule to ``1 + k`` rows with placeholder
drafts when other requests run; a request without prior Mamba state then goes through the Mamba
prefill kernels, which keep the placeholders in the state, and its tokens are wrong. The plugin's
``patches/mamba_spec_decode_padding.py`` schedules such a request unpadded. On the fp32 DFlash
engine of the tiny family (``fp32_runs["dflash"]``): the 1-token request served alone (nothing
else runs, so never padded) and the same request added while another decodes get the same
tokens, and the joining request is scheduled with its one token and no placeholder drafts, where
vLLM's condition alone would pad it (speculation on, a running request scheduled, no prefill).
"""

from __future__ import annotations

from tests.gpu.engines import LATE_TOKENS
from vllm_nemotron_spec import patches


def _join(fp32_runs) -> dict:
    return fp32_runs["dflash"].extra["then"]


def test_the_padding_patch_is_installed(fp32_runs):
    _join(fp32_runs)  # an engine has run: the scheduler module was imported
    assert patches.is_installed("mamba_spec_decode_padding"), patches.state(
        "mamba_spec_decode_padding"
    )


def test_joining_request_is_scheduled_without_placeholder_drafts(fp32_runs):
    join = _join(fp32_runs)
    assert join["alone_first_schedule"] == (1, []), join
    assert join["joined_first_schedule"] == (1, []), (
        f"the 1-token request joining a decoding batch was scheduled as "
        f"{join['joined_first_schedule']} (tokens, placeholder drafts), expected (1, [])"
    )


def test_joining_request_gets_the_tokens_it_gets_alone(fp32_runs):
    join = _join(fp32_runs)
    assert len(join["alone"]) == LATE_TOKENS
    assert join["joined"] == join["alone"]
