"""Patch: vLLM 0.33 keeps a per-batch-size schedule for the plugin's V1 DSpark proposer.

Why:     ``VllmConfig._maybe_disable_dynamic_sd_for_v1`` (vLLM 0.33) drops
         ``num_speculative_tokens_per_batch_size`` with a warning ("Dynamic speculative decoding
         is not supported with the 'dspark' speculative method on Model Runner V1") for every
         method but ngram / eagle / eagle3 / mtp / draft_model / dflash. On V1 a ``dspark`` draft
         the plugin routes runs on the plugin's proposer (``proposers/dspark.py``), which honours
         the k the runner asks for each step, like the DFlash proposer it extends.
How:     the method returns at once (the schedule is kept) when the engine runs on V1 with a
         draft ``target_hook`` routed to ``DSparkNemotron35DraftModel``; every other engine keeps
         vLLM's check. Installing checks that upstream's method still names the methods it keeps
         and still clears the schedule (``_check``); otherwise the patch is recorded as failed
         and vLLM's warning and static k stay.
Upstream: vLLM's V1 runner has no DSpark proposer (its V2 runner honours the schedule for
         DSpark itself); vLLM 0.32 has no such check.
Removal: with ``v1_nemotron35_proposers`` (when the V1 runner accepts DSpark, or V1 is retired).
         ``tests/patches/test_v1_dspark_dynamic_sd.py`` pins the upstream method.
"""

from __future__ import annotations

import functools
import inspect

from vllm_nemotron_spec.patches import replace_when_imported
from vllm_nemotron_spec.patches.v1_nemotron35_proposers import (
    DSPARK_ARCH,
    routed_draft_architecture,
)

NAME = __name__.rsplit(".", 1)[-1]
MODULE, OWNER, ATTR = "vllm.config.vllm", "VllmConfig", "_maybe_disable_dynamic_sd_for_v1"
UPSTREAM_MARKS = ('"dflash"', "use_v2_model_runner", "num_speculative_tokens_per_batch_size = None")
"""What upstream's method must still contain for this patch to mean what it says."""


def _check(method) -> None:
    source = inspect.getsource(method)
    missing = [mark for mark in UPSTREAM_MARKS if mark not in source]
    if missing:
        raise AttributeError(f"{OWNER}.{ATTR} changed: it no longer contains {missing}")


def keeps_schedule(vllm_config) -> bool:
    """Whether the schedule stays although vLLM would drop it: V1, the plugin's DSpark draft."""
    return (
        not getattr(vllm_config, "use_v2_model_runner", False)
        and routed_draft_architecture(vllm_config) == DSPARK_ARCH
    )


def _keep_for_routed_dspark(original):
    _check(original)

    @functools.wraps(original)
    def wrapper(self):
        if keeps_schedule(self):
            return None
        return original(self)

    return wrapper


def install() -> None:
    replace_when_imported(NAME, MODULE, OWNER, ATTR, _keep_for_routed_dspark)
