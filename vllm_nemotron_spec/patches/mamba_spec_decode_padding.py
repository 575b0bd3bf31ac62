"""Patch: vLLM pads a fresh prompt of one token on a Mamba/hybrid target with placeholder drafts.

Why:     ``Scheduler.schedule`` pads a waiting request with one token to schedule to ``1 + k``
         rows ("Pad new decode requests to uniform spec decoding size to preserve full cudagraph
         for this step", scheduler.py line 1131 in vLLM 0.32.0, 1308 in 0.33.0): the real token
         plus ``k`` placeholder drafts (-1) that the rejection sampler then rejects. A request
         with no prior state (``num_computed_tokens == 0``: a 1-token prompt admitted while other
         requests decode) goes through the Mamba PREFILL kernels (mamba_attn.py keeps it a
         prefill: only rows with prior state, ``padded_prompt_tail_rows``, are routed to the
         decode kernels, which keep h(N) and can roll drafts back; mamba_attn.py lines 420-440 in
         0.32.0, 421-439 in 0.33.0). The prefill kernels leave the state after all ``1 + k``
         rows, so the rejected placeholders stay in the SSM and conv states: wrong tokens from
         the second or third on, with any speculative method (ngram too). Attention KV is
         unaffected (rejected rows are overwritten), which is why the padding is harmless on
         pure-attention models.
How:     on a scheduler whose KV-cache config has Mamba layers (``has_mamba_layers``: Mamba,
         Mamba-2, GDN, ...) and speculative decoding on, ``schedule`` runs upstream's function
         with one more clause in the padding condition,
         ``and not (self.has_mamba_layers and num_computed_tokens == 0)``: such a request is
         scheduled with its one real token as an ordinary prefill. Rows with prior state are
         padded as before (upstream's decode-path rollback handles them). Every other scheduler
         (no Mamba layers, or no speculative decoding) calls vLLM's original function object.
         The cost: the step that admits such a request leaves the uniform ``1 + k`` decode batch,
         so on GPU it replays no FULL CUDA graph (a piecewise one, as for any other prefill).
Hook:    the decision reads only locals of ``schedule`` (``num_new_tokens``,
         ``num_computed_tokens``, ``scheduled_running_reqs``, ``prefill_scheduled``) and
         attributes that the same call reads elsewhere too (``num_spec_tokens``,
         ``dynamic_sd_lookup``, ``num_sampled_tokens_per_step``, ``max_model_len``). Toggling one
         of those per request (from ``_ec_transfer_pending``, the last helper called before the
         decision) would hide state changes in two wrappers and depend on the call order; undoing
         the padding after ``schedule`` returns would have to revert block allocation,
         ``_update_after_schedule`` (computed tokens, async placeholders), grammar bitmasks and
         connector metadata. So the one ``if`` is rewritten: the function's own source is
         parsed, the ``If`` whose test equals ``PADDING_CONDITION`` (compared as ASTs, so
         formatting does not matter) must occur exactly once, the clause is appended, and the
         function is compiled with its original file name and line numbers (tracebacks point at
         scheduler.py) in the scheduler module's globals; nothing else changes (the tests
         compare the ASTs). If the condition is not found exactly once, or ``schedule`` is not
         vLLM's plain function (someone wrapped it), nothing is patched, the patch is recorded
         as failed and speculative decoding on hybrid targets refuses at start-up. Reviewing a new vLLM version means reading ``PADDING_CONDITION`` against
         scheduler.py, not the whole function.
Upstream: not reported yet. Upstream's fix could equally add the clause, or route a padded row
         without prior state through the decode kernels with a zero initial state.
Removal: when vLLM stops padding requests without prior state on hybrid targets, or its Mamba
         prefill path rolls back rejected rows. ``tests/patches/test_mamba_spec_decode_padding.py``
         pins the condition (tripwire) and shows the padding without the patch.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from typing import Any, Callable

TARGET_MODULE = "vllm.v1.core.sched.scheduler"
TARGET_CLASS = "Scheduler"
TARGET_METHOD = "schedule"

# Upstream's padding condition, identical in vLLM 0.32.0 and 0.33.0.
PADDING_CONDITION = """(
    (self.num_spec_tokens > 0 and self.dynamic_sd_lookup is None)
    and self.num_sampled_tokens_per_step > 0
    and num_new_tokens == 1
    and not prefill_scheduled
    and (scheduled_running_reqs or num_computed_tokens > 0)
)"""
# The clause this patch appends to it.
NO_PAD_WITHOUT_PRIOR_STATE = "not (self.has_mamba_layers and num_computed_tokens == 0)"


class PatchMismatch(RuntimeError):
    """Upstream's ``schedule`` no longer has what this patch rewrites."""


def _expr(source: str) -> ast.expr:
    return ast.parse(textwrap.dedent(source).strip(), mode="eval").body


def find_padding_ifs(tree: ast.AST) -> list[ast.If]:
    """The ``if`` statements in ``tree`` whose test is upstream's padding condition."""
    expected = ast.dump(_expr(PADDING_CONDITION))
    return [n for n in ast.walk(tree) if isinstance(n, ast.If) and ast.dump(n.test) == expected]


def rewritten_source_tree(function: Callable) -> ast.Module:
    """The AST of ``function`` (vLLM's ``Scheduler.schedule``) with the padding clause appended,
    at the line numbers of its file.

    Raises ``PatchMismatch`` when ``function`` is not a plain function or the padding condition
    does not occur exactly once."""
    code = getattr(function, "__code__", None)
    if code is None or hasattr(function, "__wrapped__") or code.co_freevars:
        raise PatchMismatch(f"{function!r} is not vLLM's plain Scheduler.schedule")
    lines, first_line = inspect.getsourcelines(function)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    ast.increment_lineno(tree, first_line - 1)
    func = tree.body[0]
    if not (isinstance(func, ast.FunctionDef) and func.name == TARGET_METHOD):
        raise PatchMismatch(f"source of {function!r} is not a def {TARGET_METHOD}")
    matches = find_padding_ifs(func)
    if len(matches) != 1:
        raise PatchMismatch(
            f"upstream's spec-decode padding condition found {len(matches)} times in "
            f"{code.co_filename} (expected once): review {__name__}"
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
    import sys

    tree = rewritten_source_tree(function)
    namespace: dict[str, Any] = {}
    module_globals = sys.modules[function.__module__].__dict__
    code = compile(tree, function.__code__.co_filename, "exec", dont_inherit=True)
    exec(code, module_globals, namespace)
    patched = namespace[TARGET_METHOD]
    patched.__qualname__ = function.__qualname__
    patched.__doc__ = function.__doc__
    return patched


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
