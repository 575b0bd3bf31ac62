"""Patch: vLLM 0.33 keeps a per-batch-size schedule for the plugin's V1 DSpark proposer.

Why:     ``VllmConfig._maybe_disable_dynamic_sd_for_v1`` (vLLM 0.33) drops
         ``num_speculative_tokens_per_batch_size`` with a warning ("Dynamic speculative decoding
         is not supported with the 'dspark' speculative method on Model Runner V1") for every
         method but ngram / eagle / eagle3 / mtp / draft_model / dflash. On V1 a ``dspark`` draft
         the plugin routes runs on the plugin's proposer (``proposers/dspark.py``), which honours
         the k the runner asks for each step, like the DFlash proposer it extends.
How:     the method returns at once (the schedule is kept) when the engine runs on V1 with a
         draft ``target_hook`` routed to ``DSparkNemotron35DraftModel``; every other engine keeps
         vLLM's check. The method's code is the checked target; a launch that asks for a schedule
         with a routed DSpark draft on V1 refuses where the patch is not installed. vLLM 0.32 has
         no such method (it keeps the schedule): the patch is not needed there.
Upstream: vLLM's V1 runner has no DSpark proposer (its V2 runner honours the schedule for
         DSpark itself); vLLM 0.32 has no such check.
Removal: with ``v1_nemotron35_proposers`` (when the V1 runner accepts DSpark, or V1 is retired).
         ``tests/patches/test_v1_dspark_dynamic_sd.py`` pins the upstream method.
"""

from __future__ import annotations

import functools

from vllm_nemotron_spec.patches import Target, replace_when_imported
from vllm_nemotron_spec.target_hook import DSPARK_ARCH, routed_architecture

NAME = __name__.rsplit(".", 1)[-1]
MODULE, OWNER, ATTR = "vllm.config.vllm", "VllmConfig", "_maybe_disable_dynamic_sd_for_v1"
TARGETS = (
    Target(
        MODULE,
        f"{OWNER}.{ATTR}",
        {"5f0d15bc7fe4c0d9": "0.33.0"},
        absent_upstream="vLLM keeps the schedule on V1 for every method (0.32)",
    ),
)


def keeps_schedule(vllm_config) -> bool:
    """Whether the schedule stays although vLLM would drop it: V1, the plugin's DSpark draft."""
    return (
        not getattr(vllm_config, "use_v2_model_runner", False)
        and routed_architecture(getattr(vllm_config, "speculative_config", None)) == DSPARK_ARCH
    )


def _keep_for_routed_dspark(original):
    @functools.wraps(original)
    def wrapper(self):
        if keeps_schedule(self):
            return None
        return original(self)

    return wrapper


def install() -> None:
    replace_when_imported(NAME, MODULE, OWNER, ATTR, _keep_for_routed_dspark)
