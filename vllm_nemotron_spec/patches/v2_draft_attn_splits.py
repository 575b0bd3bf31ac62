"""Patch: the draft's FlashAttention 3 split count, its own setting (``NEMOTRON_SPEC_DRAFT_ATTN_SPLITS``).

Why:     under CUDA graphs vLLM lets FlashAttention 3 split every attention call's keys into up
         to ``attention_config.flash_attn_max_num_splits_for_cuda_graph`` (32) parts and merge
         them with a combine kernel. The target needs the splits (64K-token contexts); the
         Nemotron 3.5 drafts attend a block of 4-8 query rows per request over at most their
         1,024-token window, where the split planning and the combine kernel cost about as much
         as the attention itself: at one request on an H100, 0.109 ms of attention, 0.040 of
         combine and 0.015 of planning for the six layers of a DSpark 3 step
         (``benchmarks/RESULTS.md``). vLLM has one attention config for the target and its draft.
How:     the DFlash/DSpark speculator's ``attn_vllm_config`` (the config its attention builders
         are made from; DSpark's speculator inherits it) gets the draft's own cap, read from
         ``NEMOTRON_SPEC_DRAFT_ATTN_SPLITS`` (a positive integer; unset: vLLM's). Only for the
         Nemotron 3.5 drafts (the plugin's draft models, loaded before the builders are made);
         every other draft, and the target, keep vLLM's config. Backends other than
         FlashAttention ignore the field. A speed setting: where the property changed, the
         patch is not installed (the plugin's warning says so) and the variable does nothing.
Upstream: not reported yet; vLLM has no draft-only attention config.
Removal: when vLLM chooses the draft's splits itself, or takes a draft attention config.
         ``tests/patches/test_v2_draft_attn_splits.py`` pins the property (tripwire) and builds
         the config for a Nemotron 3.5 draft, another draft, and bad values.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Callable

from vllm_nemotron_spec.patches import Target, checked_symbol, install_when_imported

NAME = __name__.rsplit(".", 1)[-1]
ENV = "NEMOTRON_SPEC_DRAFT_ATTN_SPLITS"
TARGET_MODULE = "vllm.v1.worker.gpu.spec_decode.dflash.speculator"
PROPERTY = "attn_vllm_config"
TARGETS = (
    Target(
        TARGET_MODULE,
        f"DFlashSpeculator.{PROPERTY}.fget",
        {"5774d1e745818d18": "0.32.0, 0.33.0"},
    ),
)
FIELD = "flash_attn_max_num_splits_for_cuda_graph"

logger = logging.getLogger("vllm.nemotron_spec.patches")


def draft_splits(environ=os.environ) -> int | None:
    """The draft's split cap from :data:`ENV`: None where unset or empty (vLLM's value); a
    ``ValueError`` naming the variable for anything but a positive integer."""
    text = environ.get(ENV, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{ENV}={text!r}: expected a positive integer (the draft's split cap)")
    return value


def draft_attention_config(speculator: Any, config: Any, splits: int | None) -> Any:
    """``config`` (the speculator's attention ``VllmConfig``) with the draft's split cap, for a
    Nemotron 3.5 draft (its model holds the validated ``draft_spec``); else ``config`` as is."""
    if splits is None or getattr(getattr(speculator, "model", None), "draft_spec", None) is None:
        return config
    config.attention_config = dataclasses.replace(config.attention_config, **{FIELD: splits})
    _log_once(f"nemotron-spec: the draft's FlashAttention split cap is {splits} ({ENV})")
    return config


_logged: set[str] = set()


def _log_once(line: str) -> None:
    if line not in _logged:
        _logged.add(line)
        logger.info(line)


def with_draft_splits(fget: Callable) -> property:
    def attn_vllm_config(self):
        # upstream's property returns a copy: the target's config is never changed
        return draft_attention_config(self, fget(self), draft_splits())

    attn_vllm_config.__wrapped__ = fget
    attn_vllm_config._nemotron_spec_patch = True
    return property(attn_vllm_config, doc=fget.__doc__)


def install() -> None:
    from vllm_nemotron_spec import patches

    def replace_property(module) -> None:
        owner = module.DFlashSpeculator
        current = owner.__dict__[PROPERTY]
        if getattr(current.fget, "_nemotron_spec_patch", False):
            return
        checked_symbol(NAME, module, f"DFlashSpeculator.{PROPERTY}.fget")
        setattr(owner, PROPERTY, with_draft_splits(current.fget))
        patches._undo.setdefault(NAME, []).append((owner, PROPERTY, current))

    install_when_imported(NAME, TARGET_MODULE, replace_property)
