"""Patch: vLLM's V1 runner drafts Nemotron 3.5 drafts with the plugin's proposers.

Why:     vLLM's V1 runner (the only one on CPU) rejects ``method="dspark"``, and its
         ``DFlashProposer`` requires every draft layer in one KV-cache group, which a multi-layer
         draft on a hybrid (Mamba + attention) target does not satisfy.
How:     three wrappers, each acting only for a draft ``target_hook`` routed to one of the
         plugin's architectures (every other draft keeps vLLM's path):
         1. ``VllmConfig._get_v1_model_runner_unsupported_features`` drops "dspark speculative
            decoding" for ``DSparkNemotron35DraftModel``;
         2. ``GPUModelRunner.__init__`` (CPUModelRunner inherits it) replaces the drafter by the
            plugin's proposer (``proposers/``) and turns on the target's aux hidden states;
         3. ``GPUModelRunner._input_fits_in_drafter`` counts the bonus row of DSpark's
            bonus-anchor layout (vLLM counts it only for ``method == "dflash"``).
Upstream: vLLM implements DSpark and multi-group drafting in the V2 runner only.
Removal: when the V1 runner accepts DSpark and multi-group DFlash drafts, or V1 is retired on CPU.
         ``tests/patches/test_v1_nemotron35_proposers.py`` pins the upstream symbols.
"""

from __future__ import annotations

import functools
from typing import Any

from vllm_nemotron_spec.patches import replace_when_imported

V1_DSPARK_REJECTION = "dspark speculative decoding"
DFLASH_ARCH = "DFlashNemotron35DraftModel"
DSPARK_ARCH = "DSparkNemotron35DraftModel"


def routed_draft_architecture(vllm_config: Any) -> str | None:
    """The plugin's draft architecture this engine was routed to, or None."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or spec.method not in ("dflash", "dspark"):
        return None
    draft = getattr(spec, "draft_model_config", None)
    archs = list(getattr(getattr(draft, "hf_config", None), "architectures", None) or [])
    for arch in (DFLASH_ARCH, DSPARK_ARCH):
        if archs == [arch]:
            return arch
    return None


def _unsupported_features(original):
    @functools.wraps(original)
    def wrapper(self):
        unsupported = original(self)
        if routed_draft_architecture(self) == DSPARK_ARCH:
            unsupported = [u for u in unsupported if u != V1_DSPARK_REJECTION]
        return unsupported

    return wrapper


def _runner_init(original):
    @functools.wraps(original)
    def wrapper(self, vllm_config, device, *args, **kwargs):
        original(self, vllm_config, device, *args, **kwargs)
        arch = routed_draft_architecture(vllm_config)
        if arch is None or not hasattr(self, "drafter"):
            return
        if arch == DSPARK_ARCH:
            from vllm_nemotron_spec.proposers.dspark import Nemotron35DSparkProposer as cls
        else:
            from vllm_nemotron_spec.proposers.dflash import Nemotron35DFlashProposer as cls
        self.drafter = cls(vllm_config, self.device, self)
        self.use_aux_hidden_state_outputs = True

    return wrapper


def _input_fits(original):
    @functools.wraps(original)
    def wrapper(self, common_attn_metadata):
        fits = original(self, common_attn_metadata)
        drafter = getattr(self, "drafter", None)
        if fits and getattr(drafter, "bonus_anchor_row", False):
            # vLLM added no bonus row for method "dspark"; the bonus-anchor layout has one.
            return (
                common_attn_metadata.max_seq_len + self.num_spec_tokens + 1
                <= self.effective_drafter_max_model_len
            )
        return fits

    return wrapper


PATCHES = (
    (
        "vllm.config.vllm",
        "VllmConfig",
        "_get_v1_model_runner_unsupported_features",
        _unsupported_features,
    ),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "__init__", _runner_init),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_input_fits_in_drafter", _input_fits),
)


def install() -> None:
    for module, cls_name, attr, make in PATCHES:
        replace_when_imported(__name__.rsplit(".", 1)[-1], module, cls_name, attr, make)
