"""Patch: vLLM 0.32 drops the trailing prefix-cache block for DFlash / DSpark as for EAGLE.

Why:     ``SpeculativeConfig.use_eagle_block_drop()`` is true for every method that uses target
         hidden states, so the scheduler backs every prefix-cache hit off by one block (and Mamba
         align mode stores the prompt's checkpoint one block earlier): a multi-turn conversation
         reuses one block less per turn than plain decoding. The drop exists because an EAGLE
         draft's KV at a position depends on the NEXT token; a DFlash / DSpark draft builds its
         context KV from the target's hidden state at that position alone, in the same step.
How:     ``SpeculativeConfig.use_eagle_block_drop`` is wrapped: False for a draft ``target_hook``
         routed to the plugin's draft classes (logged once per process), vLLM's answer otherwise.
Upstream: vLLM PR #54163; vLLM 0.33 has it, so the patch applies to 0.32 only.
Removal: with vLLM 0.32 support. ``tests/patches/test_nemotron35_prefix_cache_block.py`` checks
         that vLLM 0.32 still drops the block for DFlash/DSpark, and ``tests/e2e/
         test_recipe_serving.py`` that hits equal plain decoding's turn for turn.
"""

from __future__ import annotations

import functools

from vllm_nemotron_spec.patches import Target, replace_when_imported
from vllm_nemotron_spec.target_hook import LOGGER_NAME, routed_architecture

TARGET_MODULE = "vllm.config.speculative"
TARGET_CLASS = "SpeculativeConfig"
TARGET_SYMBOL = "use_eagle_block_drop"

TARGETS = (
    Target(
        TARGET_MODULE,
        f"{TARGET_CLASS}.{TARGET_SYMBOL}",
        {"48e941f38a9de5f1": "0.32.0"},
        fixed_upstream={"9f10a755a6398d8c": "0.33.0"},  # needs_eagle_block_drop excludes them
    ),
)

_logged = False


def _wrap(original):
    @functools.wraps(original)
    def use_eagle_block_drop(self) -> bool:
        global _logged
        drop = original(self)
        if not drop or routed_architecture(self) is None:
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
