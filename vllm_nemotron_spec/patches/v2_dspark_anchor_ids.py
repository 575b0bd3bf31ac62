"""Patch (read only): the fused Markov walk reads two private fields of vLLM 0.33's
``DSparkSpeculator``: ``_anchor_idx`` (the row of each request's anchor token in the input
buffer) and ``_draft_topk`` (reduced-vocabulary drafting, which the fused walk does not do).

How: nothing is replaced. When the speculator module is imported, ``install`` checks that
``DSparkSpeculator.__init__`` still has a checked fingerprint and assigns both fields; if not,
the patch is not installed and the draft model's ``sample_sequential`` hook declines, so vLLM's
own Markov loop runs.
"""

from __future__ import annotations

from typing import Any

from vllm_nemotron_spec.patches import Target, check_when_imported, is_installed

NAME = __name__.rsplit(".", 1)[-1]
TARGET_MODULE = "vllm.v1.worker.gpu.spec_decode.dspark.speculator"
TARGETS = (
    Target(TARGET_MODULE, "DSparkSpeculator.__init__", {"887c11adc2937322": "0.32.0, 0.33.0"}),
)


def installed() -> bool:
    return is_installed(NAME)


def anchor_token_ids(speculator: Any, num_reqs: int):
    """Each request's anchor (bonus) token id, [num_reqs]."""
    return speculator.input_buffers.input_ids[speculator._anchor_idx[:num_reqs]]


def draft_topk(speculator: Any) -> int | None:
    """The speculator's reduced-vocabulary top-k, None when it drafts over the whole vocabulary."""
    return getattr(speculator, "_draft_topk", None)


def install() -> None:
    check_when_imported(NAME, TARGET_MODULE, "DSparkSpeculator.__init__")
