"""The attention decision (``vllm_nemotron_spec/attention.py``) on the real device, and the
backends the engine really runs.

For the bf16 engines with a routed draft (the NVFP4 DSpark draft, the compressed-tensors DFlash
draft): the plugin's NemotronH config hook decided once, from the device's own compute capability;
every backend it pinned is the one the worker's attention groups run (target layers in the model
runner's groups, draft layers in the speculator's); where it left the choice to vLLM and the
default is known (Hopper, bf16: FLASH_ATTN with FlashAttention 3, as the decision's reason says),
the engine runs that. Plain decoding routes no draft: the plugin decides nothing and the engine
runs vLLM's own choice.
"""

from __future__ import annotations

import pytest

from tests.gpu.checks import expected_attention

ENGINES = ["dspark_nvfp4", "dflash_ct"]


def _decision(run):
    decisions = run.extra["attention_decisions"]
    assert len(decisions) == 1, f"the attention hook decided {len(decisions)} times: {decisions}"
    return decisions[0]


@pytest.mark.parametrize("name", ENGINES)
def test_decision_reads_the_devices_capability(bf16_runs, gpu_session, name):
    inputs, decision = _decision(bf16_runs[name])
    major, minor = gpu_session["capability"]
    assert inputs.capability == (major, minor)
    assert decision.reason.startswith(f"SM{major}{minor}: target "), decision.reason


def _check_side(backends: dict, versions: dict, pinned, expected, side: str, reason: str) -> None:
    assert backends, f"no {side} attention layer found in the engine"
    if expected is None:
        return  # nothing pinned, vLLM's default not known for this device: recorded only
    backend, version = expected
    if pinned is None and version is not None:  # the decision's reason names vLLM's default
        assert f"{backend}, FA{version}" in reason, reason
    wrong = {layer: b for layer, b in backends.items() if b != backend}
    assert not wrong, f"{side} layers run {wrong}, expected {backend} ({reason})"
    if version is not None:
        got = {layer: versions.get(layer) for layer in backends}
        assert set(got.values()) == {version}, f"{side} FlashAttention versions {got} ({reason})"


@pytest.mark.parametrize("name", ENGINES)
def test_engine_runs_the_decided_target_backend(bf16_runs, gpu_session, name):
    run = bf16_runs[name]
    _, decision = _decision(run)
    expected = expected_attention(decision.target_backend, gpu_session["capability"], "bfloat16")
    facts = run.facts
    _check_side(
        facts.target_backends,
        facts.flash_attn_versions,
        decision.target_backend,
        expected,
        "target",
        decision.reason,
    )


def test_plain_decoding_keeps_vllms_backend(bf16_runs, gpu_session):
    run = bf16_runs["plain"]
    assert run.extra["attention_decisions"] == [], "the plugin decided attention without a draft"
    expected = expected_attention(None, gpu_session["capability"], "bfloat16")
    backends = run.facts.target_backends
    assert backends, "no target attention layer found in the engine"
    if expected is None:
        return  # vLLM's default is not known for this device: recorded only
    backend, version = expected
    assert set(backends.values()) == {backend}, backends
    got = {layer: run.facts.flash_attn_versions.get(layer) for layer in backends}
    assert set(got.values()) == {version}, f"FlashAttention versions {got}"


@pytest.mark.parametrize("name", ENGINES)
def test_engine_runs_the_decided_draft_backend(bf16_runs, gpu_session, name):
    run = bf16_runs[name]
    _, decision = _decision(run)
    expected = expected_attention(decision.draft_backend, gpu_session["capability"], "bfloat16")
    facts = run.facts
    _check_side(
        facts.draft_backends,
        facts.flash_attn_versions,
        decision.draft_backend,
        expected,
        "draft",
        decision.reason,
    )
    assert not set(facts.draft_backends) & set(facts.target_backends)
