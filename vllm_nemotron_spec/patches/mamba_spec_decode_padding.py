"""Patch: vLLM pads a fresh one-token prompt on a Mamba/hybrid target with placeholder drafts.

Why:     ``Scheduler.schedule`` pads a request with one token to schedule to ``1 + k`` rows (the
         real token plus ``k`` placeholder drafts that the rejection sampler rejects) to keep a
         uniform batch for full CUDA graphs. A request with no prior state (a 1-token prompt
         admitted while others decode) runs the Mamba PREFILL kernels, which keep the state after
         all ``1 + k`` rows: the rejected placeholders stay in the SSM and conv states, and wrong
         tokens follow, with any speculative method (ngram too). Attention KV is unaffected
         (rejected rows are overwritten), so pure-attention models do not show it.
How:     on a scheduler with Mamba layers and speculative decoding, ``schedule`` is upstream's
         function with :data:`NO_PAD_WITHOUT_PRIOR_STATE` appended to the padding condition
         (:func:`rewritten_source_tree`): such a request is scheduled as an ordinary prefill (on
         GPU that step replays a piecewise CUDA graph, not a full one). Rows with prior state are
         padded as before (the decode kernels roll drafts back). Other schedulers call vLLM's
         original. Where the rewrite does not apply, the patch is recorded as failed and
         speculative decoding on hybrid targets refuses at start-up.
Upstream: not reported yet; a fix could add the clause, or route a padded row without prior state
         through the decode kernels with a zero initial state.
Removal: when vLLM stops padding requests without prior state on hybrid targets, or its Mamba
         prefill path rolls back rejected rows. ``tests/patches/test_mamba_spec_decode_padding.py``
         pins the condition (tripwire) and shows the padding without the patch.
"""

from __future__ import annotations

import ast
import functools
import textwrap
from typing import Any, Callable

from vllm_nemotron_spec.patches import RewriteMismatch, Target, compile_rewrite, source_tree

TARGET_MODULE = "vllm.v1.core.sched.scheduler"
TARGET_CLASS = "Scheduler"
TARGET_METHOD = "schedule"

# The function rewritten: a rewrite of any other code would be a guess, so none is made.
TARGETS = (
    Target(
        TARGET_MODULE,
        f"{TARGET_CLASS}.{TARGET_METHOD}",
        {"f0bf9ee1ca0e0316": "0.32.0", "4632061d97d252d8": "0.33.0"},
    ),
)

# Upstream's padding condition, identical in vLLM 0.32.0 and 0.33.0 (scheduler.py line 1131 in
# 0.32.0, 1308 in 0.33.0). Reviewing a new vLLM version means reading it against scheduler.py.
PADDING_CONDITION = """(
    (self.num_spec_tokens > 0 and self.dynamic_sd_lookup is None)
    and self.num_sampled_tokens_per_step > 0
    and num_new_tokens == 1
    and not prefill_scheduled
    and (scheduled_running_reqs or num_computed_tokens > 0)
)"""
# The clause this patch appends to it.
NO_PAD_WITHOUT_PRIOR_STATE = "not (self.has_mamba_layers and num_computed_tokens == 0)"


PatchMismatch = RewriteMismatch  # upstream's ``schedule`` lacks what this patch rewrites


def _expr(source: str) -> ast.expr:
    return ast.parse(textwrap.dedent(source).strip(), mode="eval").body


def find_padding_ifs(tree: ast.AST) -> list[ast.If]:
    """The ``if`` statements in ``tree`` whose test is upstream's padding condition."""
    expected = ast.dump(_expr(PADDING_CONDITION))
    return [n for n in ast.walk(tree) if isinstance(n, ast.If) and ast.dump(n.test) == expected]


def rewritten_source_tree(function: Callable) -> ast.Module:
    """The AST of ``function`` (vLLM's ``Scheduler.schedule``) with the padding clause appended,
    at the line numbers of its file (tracebacks point at scheduler.py).

    Why a source rewrite: the decision reads only locals of ``schedule`` and attributes the same
    call reads elsewhere, so toggling one of those per request would hide state changes in
    wrappers and depend on the call order, and undoing the padding after ``schedule`` returns would
    have to revert block allocation, ``_update_after_schedule``, grammar bitmasks and connector
    metadata. The ``If`` whose test equals :data:`PADDING_CONDITION` (compared as ASTs, so
    formatting does not matter) gets the clause; nothing else changes.

    Raises ``PatchMismatch`` when ``function`` is not a plain function or the padding condition
    does not occur exactly once."""
    tree = source_tree(function, TARGET_METHOD)
    func = tree.body[0]
    matches = find_padding_ifs(func)
    if len(matches) != 1:
        raise PatchMismatch(
            f"upstream's spec-decode padding condition found {len(matches)} times in "
            f"{function.__code__.co_filename} (expected once): review {__name__}"
        )
    node = matches[0]
    clause = _expr(NO_PAD_WITHOUT_PRIOR_STATE)
    node.test = ast.BoolOp(op=ast.And(), values=[node.test, clause])
    for n in ast.walk(clause):  # the clause sits on the condition's first line
        ast.copy_location(n, node)
    ast.fix_missing_locations(tree)
    return tree


def rewrite_schedule(function: Callable) -> Callable:
    """``function`` (vLLM's ``Scheduler.schedule``) recompiled from ``rewritten_source_tree``, in
    its module's globals, under its file name."""
    return compile_rewrite(function, rewritten_source_tree(function))


def no_padding_without_prior_state(scheduler: Any) -> bool:
    """Whether this scheduler gets the patched ``schedule`` (hybrid target, speculative on)."""
    return bool(getattr(scheduler, "has_mamba_layers", False)) and (
        getattr(scheduler, "num_spec_tokens", 0) > 0
    )


def _schedule(original: Callable, patched: Callable) -> Callable:
    @functools.wraps(original)
    def schedule(self, *args, **kwargs):
        if no_padding_without_prior_state(self):
            return patched(self, *args, **kwargs)
        return original(self, *args, **kwargs)

    return schedule


def _schedule_with_rewrite(original: Callable) -> Callable:
    """``_schedule`` around ``original`` and its rewrite; raises ``PatchMismatch`` (the patch is
    then recorded as failed and the features that need it refuse) when it cannot be rewritten."""
    return _schedule(original, rewrite_schedule(original))


def install() -> None:
    from vllm_nemotron_spec.patches import replace_when_imported

    replace_when_imported(
        __name__.rsplit(".", 1)[-1],
        TARGET_MODULE,
        TARGET_CLASS,
        TARGET_METHOD,
        _schedule_with_rewrite,
    )
