"""Patch: vLLM 0.32 warns "no KV cache group could be identified as the draft model's" for the
plugin's Nemotron 3.5 drafts, right before the plugin's own log line saying its proposers handle
multi-group drafts.

How: ``kv_cache_utils._warn_if_unannotated_eagle_mamba`` returns at once for a draft routed to the
plugin's architectures; every other draft keeps vLLM's warning.
"""

from __future__ import annotations

import functools

from vllm_nemotron_spec.patches import Target, replace_when_imported
from vllm_nemotron_spec.target_hook import routed_architecture

TARGET_MODULE = "vllm.v1.core.kv_cache_utils"
TARGET_SYMBOL = "_warn_if_unannotated_eagle_mamba"

TARGETS = (Target(TARGET_MODULE, TARGET_SYMBOL, {"07d0680c575bd599": "0.32.0"}),)


def _draft_group_warning(original):
    @functools.wraps(original)
    def wrapper(vllm_config, kv_cache_groups, *args, **kwargs):
        if routed_architecture(getattr(vllm_config, "speculative_config", None)) is not None:
            return None
        return original(vllm_config, kv_cache_groups, *args, **kwargs)

    return wrapper


def install() -> None:
    replace_when_imported(
        __name__.rsplit(".", 1)[-1], TARGET_MODULE, None, TARGET_SYMBOL, _draft_group_warning
    )
