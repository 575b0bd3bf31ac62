"""Patch: vLLM warns "no KV cache group could be identified as the draft model's" for the plugin's
Nemotron 3.5 drafts, right before the plugin's own log line saying its proposers handle
multi-group drafts.

How: ``_warn_if_unannotated_eagle_mamba`` returns at once for a draft routed to the plugin's
architectures; every other draft keeps vLLM's warning. vLLM 0.32 defines it in ``kv_cache_utils``
(called with the ``VllmConfig``), 0.33 in ``kv_cache_planning`` (called with the
``SpeculativeConfig``); the patch replaces it in the module this vLLM has.
"""

from __future__ import annotations

import functools
import importlib.util

from vllm_nemotron_spec.patches import Target, replace_when_imported
from vllm_nemotron_spec.target_hook import routed_architecture

TARGET_SYMBOL = "_warn_if_unannotated_eagle_mamba"
UTILS = "vllm.v1.core.kv_cache_utils"  # vLLM 0.32: (vllm_config, kv_cache_groups)
PLANNING = "vllm.v1.core.kv_cache_planning"  # vLLM 0.33: (spec_config, kv_cache_groups)

TARGETS = (
    Target(UTILS, TARGET_SYMBOL, {"07d0680c575bd599": "0.32.0"},
           absent_upstream=f"vLLM 0.33 defines it in {PLANNING}"),
    Target(PLANNING, TARGET_SYMBOL, {"75594ac107940f32": "0.33.0"},
           absent_upstream=f"vLLM 0.32 defines it in {UTILS}"),
)  # fmt: skip


def _draft_group_warning(speculative_config_of):
    def make(original):
        @functools.wraps(original)
        def wrapper(config, kv_cache_groups, *args, **kwargs):
            if routed_architecture(speculative_config_of(config)) is not None:
                return None
            return original(config, kv_cache_groups, *args, **kwargs)

        return wrapper

    return make


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def install() -> None:
    name = __name__.rsplit(".", 1)[-1]
    if _has_module(PLANNING):
        replace_when_imported(
            name, PLANNING, None, TARGET_SYMBOL, _draft_group_warning(lambda c: c)
        )
    else:
        speculative_config = lambda c: getattr(c, "speculative_config", None)  # noqa: E731
        replace_when_imported(
            name, UTILS, None, TARGET_SYMBOL, _draft_group_warning(speculative_config)
        )
