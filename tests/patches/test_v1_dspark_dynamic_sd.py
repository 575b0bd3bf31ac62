"""The vLLM 0.33 patch that keeps a per-batch-size schedule for the plugin's V1 DSpark proposer:
for whom it acts, and tripwires on the upstream method it replaces."""

from __future__ import annotations

import types

import pytest

from vllm_nemotron_spec.patches import v1_dspark_dynamic_sd as patch

SCHEDULE = [[1, 4, 3], [5, 16, 1]]


def _config(method, archs, v2=False):
    hf = types.SimpleNamespace(architectures=archs)
    spec = types.SimpleNamespace(
        method=method,
        draft_model_config=types.SimpleNamespace(hf_config=hf),
        num_speculative_tokens=3,
        num_speculative_tokens_per_batch_size=list(SCHEDULE),
    )
    return types.SimpleNamespace(speculative_config=spec, use_v2_model_runner=v2)


def _upstream(self):
    """vLLM 0.33's method, in short: V1 keeps the schedule only for the methods it names."""
    spec = self.speculative_config
    if self.use_v2_model_runner or spec.method in ("ngram", "eagle", "dflash"):
        return
    spec.num_speculative_tokens_per_batch_size = None


@pytest.mark.parametrize(
    "method, archs, v2, kept",
    [
        ("dspark", ["DSparkNemotron35DraftModel"], False, True),  # the plugin's V1 proposer
        ("dspark", ["Qwen3DSparkModel"], False, False),  # vLLM's own draft: vLLM decides
        ("dspark", ["DSparkNemotron35DraftModel"], True, True),  # V2 keeps it anyway
        ("medusa", ["DSparkNemotron35DraftModel"], False, False),
    ],
)
def test_kept_only_for_the_routed_dspark_draft(method, archs, v2, kept):
    wrapped = patch._keep_for_routed_dspark(_upstream)
    config = _config(method, archs, v2)
    wrapped(config)
    schedule = config.speculative_config.num_speculative_tokens_per_batch_size
    assert schedule == (SCHEDULE if kept else None)


def test_a_changed_upstream_method_is_a_changed_target():
    from vllm_nemotron_spec import patches

    def changed(self):
        self.speculative_config.num_speculative_tokens_per_batch_size = []

    with pytest.raises(patches.ShapeMismatch, match="_maybe_disable_dynamic_sd_for_v1 changed"):
        patches.check_target(patch.TARGETS[0], changed)


def test_not_needed_where_vllm_has_no_such_check():
    """vLLM 0.32 (the CPU tests) keeps the schedule on V1 for every method: no method to patch,
    and the patch says it is not needed rather than missing (a schedule launch is not refused)."""
    from vllm.config.vllm import VllmConfig

    from vllm_nemotron_spec import patches

    assert getattr(VllmConfig, patch.ATTR, None) is None  # tripwire: vLLM 0.32 has no such check
    patches.apply_one(patch.NAME)
    assert patches.state(patch.NAME).startswith("not needed on vLLM")
    assert patches.is_satisfied(patch.NAME)
