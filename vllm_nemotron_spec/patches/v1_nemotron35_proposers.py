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

from vllm_nemotron_spec.patches import Target, check_when_imported, replace_when_imported
from vllm_nemotron_spec.target_hook import DSPARK_ARCH, routed_architecture

V1_DSPARK_REJECTION = "dspark speculative decoding"
CONFIG_MODULE = "vllm.config.vllm"
RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
DFLASH_MODULE = "vllm.v1.spec_decode.dflash"
BASE_MODULE = "vllm.v1.spec_decode.llm_base_proposer"
_BOTH = "0.32.0, 0.33.0"

# The three wrapped methods, and the V1 proposer code the plugin's proposers (proposers/) extend:
# every base method they override or call through super(), and the propose() loop driving them.
TARGETS = (
    Target(
        CONFIG_MODULE,
        "VllmConfig._get_v1_model_runner_unsupported_features",
        {"337b1fe8ad139e9a": "0.32.0", "183e95226168ecad": "0.33.0"},
    ),
    Target(
        RUNNER_MODULE,
        "GPUModelRunner.__init__",
        {"e59f6f67cc50027e": "0.32.0", "3671759c9e4c00e2": "0.33.0"},
    ),
    Target(RUNNER_MODULE, "GPUModelRunner._input_fits_in_drafter", {"e52b5c9a76c8a122": _BOTH}),
    Target(DFLASH_MODULE, "DFlashProposer.__init__", {"a3a7e0a685d58faa": _BOTH}),
    Target(DFLASH_MODULE, "DFlashProposer.set_inputs_first_pass", {"644f432be14df727": _BOTH}),
    Target(
        DFLASH_MODULE, "DFlashProposer.build_model_inputs_first_pass", {"56fee4334b03247b": _BOTH}
    ),
    Target(
        DFLASH_MODULE,
        "DFlashProposer.build_per_group_and_layer_attn_metadata",
        {"09dcf21d536e4dae": _BOTH},
    ),
    Target(BASE_MODULE, "SpecDecodeBaseProposer.propose", {"9500e27f233aae2f": _BOTH}),
    Target(BASE_MODULE, "SpecDecodeBaseProposer._get_slot_mapping", {"414ab1c119d6d1d0": _BOTH}),
    Target(BASE_MODULE, "SpecDecodeBaseProposer._sample_draft_tokens", {"4122076b8a61a480": _BOTH}),
    Target(BASE_MODULE, "SpecDecodeBaseProposer._sample_from_logits", {"8d07854f1a2e3742": _BOTH}),
    Target(
        BASE_MODULE, "SpecDecodeBaseProposer.initialize_attn_backend", {"efaa31ff428cc1da": _BOTH}
    ),
    Target(
        BASE_MODULE,
        "SpecDecodeBaseProposer.validate_same_kv_cache_group",
        {"b2e09a80eaef779d": _BOTH},
    ),
)


def _unsupported_features(original):
    @functools.wraps(original)
    def wrapper(self):
        unsupported = original(self)
        if routed_architecture(self.speculative_config) == DSPARK_ARCH:
            unsupported = [u for u in unsupported if u != V1_DSPARK_REJECTION]
        return unsupported

    return wrapper


def _runner_init(original):
    @functools.wraps(original)
    def wrapper(self, vllm_config, device, *args, **kwargs):
        original(self, vllm_config, device, *args, **kwargs)
        arch = routed_architecture(vllm_config.speculative_config)
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


REPLACED = (
    (
        CONFIG_MODULE,
        "VllmConfig",
        "_get_v1_model_runner_unsupported_features",
        _unsupported_features,
    ),
    (RUNNER_MODULE, "GPUModelRunner", "__init__", _runner_init),
    (RUNNER_MODULE, "GPUModelRunner", "_input_fits_in_drafter", _input_fits),
)


def install() -> None:
    name = __name__.rsplit(".", 1)[-1]
    replaced = {f"{module}.{cls}.{attr}" for module, cls, attr, _ in REPLACED}
    for target in TARGETS:
        if target.where not in replaced:
            check_when_imported(name, target.module, target.qualname)
    for module, cls_name, attr, make in REPLACED:
        replace_when_imported(name, module, cls_name, attr, make)
