"""A name for the architecture vLLM invents when a DSpark draft is served with ``method: dflash``.

vLLM's ``EAGLEConfig`` prefixes every draft architecture with ``DFlash`` under that method, so the
official ``Qwen3DSparkModel`` becomes ``DFlashQwen3DSparkModel`` and start-up fails with "Model
architectures ['DFlashQwen3DSparkModel'] are not supported", which names neither the method nor
the fix. With this name registered, start-up reaches the plugin's NemotronH hook, whose draft check
says "speculative_config.method is "dflash" but the draft ... is a dspark checkpoint: use
{"method": "dspark", ...}". A draft the hook does not check (not the Nemotron 3.5 layout) stops
here with the same advice. Nothing is ever built under this name.
"""

from __future__ import annotations

import torch.nn as nn

ARCHITECTURE = "DFlashQwen3DSparkModel"


class DSparkDraftUnderDFlash(nn.Module):
    """Refuses to build: a DSpark draft needs ``method: dspark``."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        draft = vllm_config.speculative_config.draft_model_config.model
        raise ValueError(
            f'speculative_config.method is "dflash" but the draft {draft} is a DSpark checkpoint '
            '(architecture Qwen3DSparkModel): use {"method": "dspark", ...}'
        )
