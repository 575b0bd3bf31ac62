"""Patch: vLLM 0.32 drops the trailing prefix-cache block for DFlash / DSpark as for EAGLE.

Why:     ``SpeculativeConfig.use_eagle_block_drop()`` is true for every method that uses target
         hidden states, DFlash and DSpark included. The scheduler, the KV-cache coordinator and
         the Mamba checkpoint builder then back every prefix-cache hit off by one block (and, in
         Mamba align mode, store the prompt's checkpoint one block earlier): on the tiny family a
         multi-turn conversation served with DFlash/DSpark reuses one 128-token block less per
         turn than plain decoding (128/256/512 cached tokens instead of 256/384/640). The drop
         exists because an EAGLE draft's KV at a position depends on the NEXT token; a DFlash /
         DSpark draft builds its context KV from the target's hidden state at that position
         alone, written in the same step as the target's, so the trailing block is complete.
How:     ``SpeculativeConfig.use_eagle_block_drop`` is wrapped: False for a draft that
         ``target_hook`` routed to the plugin's Nemotron 3.5 draft classes (logged once per
         process); vLLM's answer for everything else. vLLM's scheduler still logs its generic
         "EAGLE trailing prefix-cache block dropping is disabled" warning.
Upstream: vLLM PR #54163; vLLM 0.33 has it (``SpeculativeConfig.needs_eagle_block_drop`` excludes
         DFlash and DSpark), so the patch applies to 0.32 only.
Removal: with vLLM 0.32 support. ``tests/patches/test_nemotron35_prefix_cache_block.py`` checks
         that vLLM 0.32 still drops the block for DFlash/DSpark, and ``tests/e2e/
         test_prefix_caching_serve.py`` that hits equal plain decoding's turn for turn.
"""

from __future__ import annotations

import functools
from typing import Any

from vllm_nemotron_spec.patches import replace_when_imported
from vllm_nemotron_spec.patches.v1_nemotron35_proposers import DFLASH_ARCH, DSPARK_ARCH
from vllm_nemotron_spec.target_hook import LOGGER_NAME  # the routing decision's logger

TARGET_MODULE = "vllm.config.speculative"
TARGET_CLASS = "SpeculativeConfig"
TARGET_SYMBOL = "use_eagle_block_drop"

_logged = False


def routed_nemotron35_draft(spec_config: Any) -> bool:
    """Whether ``spec_config`` is a DFlash/DSpark draft routed to the plugin's classes."""
    if getattr(spec_config, "method", None) not in ("dflash", "dspark"):
        return False
    draft = getattr(spec_config, "draft_model_config", None)
    archs = list(getattr(getattr(draft, "hf_config", None), "architectures", None) or [])
    return archs in ([DFLASH_ARCH], [DSPARK_ARCH])


def _wrap(original):
    @functools.wraps(original)
    def use_eagle_block_drop(self) -> bool:
        global _logged
        drop = original(self)
        if not drop or not routed_nemotron35_draft(self):
            return drop
        if not _logged:
            _logged = True
            from vllm.logger import init_logger

            init_logger(LOGGER_NAME).info(
                "nemotron-spec: %s draft (Nemotron 3.5): prefix-cache hits keep their trailing "
                "block (the draft's KV at a position needs no later token)",
                self.method,
            )
        return False

    return use_eagle_block_drop


def install() -> None:
    replace_when_imported(
        __name__.rsplit(".", 1)[-1], TARGET_MODULE, TARGET_CLASS, TARGET_SYMBOL, _wrap
    )
