"""Patch (read only): the fused Markov walk reads two private fields of vLLM 0.33's
``DSparkSpeculator``: ``_anchor_idx`` (the row of each request's anchor token in the input
buffer) and ``_draft_topk`` (reduced-vocabulary drafting, which the fused walk does not do).

How: nothing is replaced. When the speculator module is imported, ``install`` checks that
``DSparkSpeculator.__init__`` still assigns both fields; if not, the patch is recorded as failed
and the draft model's ``sample_sequential`` hook declines, so vLLM's own Markov loop runs.
"""

from __future__ import annotations

import inspect
from typing import Any

from vllm_nemotron_spec.patches import INSTALLED, install_when_imported, state

NAME = __name__.rsplit(".", 1)[-1]
TARGET_MODULE = "vllm.v1.worker.gpu.spec_decode.dspark.speculator"
FIELDS = ("self._anchor_idx", "self._draft_topk")


def installed() -> bool:
    return state(NAME) == INSTALLED


def anchor_token_ids(speculator: Any, num_reqs: int):
    """Each request's anchor (bonus) token id, [num_reqs]."""
    return speculator.input_buffers.input_ids[speculator._anchor_idx[:num_reqs]]


def draft_topk(speculator: Any) -> int | None:
    """The speculator's reduced-vocabulary top-k, None when it drafts over the whole vocabulary."""
    return getattr(speculator, "_draft_topk", None)


def _check(module) -> None:
    source = inspect.getsource(module.DSparkSpeculator.__init__)
    missing = [f for f in FIELDS if f"{f} =" not in source and f"{f}:" not in source]
    if missing:
        raise AttributeError(f"DSparkSpeculator.__init__ no longer sets {', '.join(missing)}")


def install() -> None:
    install_when_imported(NAME, TARGET_MODULE, _check)
