"""Patch: a per-batch-size speculation schedule starts on a hybrid (Mamba) target with CUDA graphs.

Why:     with ``num_speculative_tokens_per_batch_size``, vLLM's V2 runner captures a full CUDA
         graph for each k of the schedule: uniform decode batches of ``1 + k`` query rows. The
         Mamba metadata builder's ``build_for_cudagraph_capture`` first checks the capture fits
         (``max_query_len <= 1 + num_spec_tokens``), then asserts ``max_query_len == 1 +
         num_spec_tokens``: the first k below ``num_speculative_tokens`` kills the engine at
         start-up with a bare ``AssertionError`` (every NemotronH, Qwen3-Next or other hybrid
         target, any speculative method). Seen on an H100 with vLLM 0.33.0: ``tune``'s engine
         for k = 1 of a DSpark block of 7 (the schedule ``[[1, 64, 1]]``).
How:     the method is upstream's with that one equality assertion removed (a source rewrite,
         :func:`rewritten_source_tree`); the bound above it stays. The Mamba decode kernels read
         each request's rows from ``query_start_loc_d`` and its accepted count from
         ``num_accepted_tokens`` (``causal_conv1d_update``, ``selective_state_update``), the path
         a schedule's steps already take at run time without graphs, so ``1 + k`` rows capture as
         they run. Installed on every platform (CPU engines capture no graphs and never call
         it); where the assertion is not found the patch is not installed and a schedule on a
         hybrid target refuses at start-up (``target_hook.needed_patches``).
Upstream: not reported yet; the fix is to relax the equality to the bound (docs/upstream.md).
Removal: when upstream's capture accepts every ``1 + k`` of the schedule.
         ``tests/patches/test_mamba_schedule_graph_capture.py`` pins the method (tripwire) and
         shows the start-up failure without the patch; ``tests/gpu/test_gpu_batch_size_schedule.py``
         serves a schedule with CUDA graphs on a GPU, tokens equal to plain decoding's.
"""

from __future__ import annotations

import ast
from typing import Callable

from vllm_nemotron_spec.patches import RewriteMismatch, Target, compile_rewrite, source_tree

TARGET_MODULE = "vllm.v1.attention.backends.mamba_attn"
TARGET_CLASS = "BaseMambaAttentionMetadataBuilder"
TARGET_METHOD = "build_for_cudagraph_capture"
TARGETS = (
    Target(
        TARGET_MODULE,
        f"{TARGET_CLASS}.{TARGET_METHOD}",
        {"36c05618bf21dff2": "0.32.0, 0.33.0"},
    ),
)

# The assertion removed, identical in vLLM 0.32.0 and 0.33.0; compared as an AST.
UPSTREAM_EQUALITY = "assert m.max_query_len == 1 + self.num_spec_tokens"


def rewritten_source_tree(method: Callable) -> ast.Module:
    """The AST of ``method`` (upstream's ``build_for_cudagraph_capture``) without the equality
    assertion; ``RewriteMismatch`` unless it occurs exactly once, as a statement of the body."""
    tree = source_tree(method, TARGET_METHOD)
    expected = ast.dump(ast.parse(UPSTREAM_EQUALITY).body[0])
    body = tree.body[0].body
    found = [i for i, node in enumerate(body) if ast.dump(node) == expected]
    elsewhere = [n for n in ast.walk(tree) if ast.dump(n) == expected]
    if len(found) != 1 or len(elsewhere) != 1:
        raise RewriteMismatch(
            f"upstream's equality assertion found {len(elsewhere)} times in "
            f"{method.__code__.co_filename} (expected once, in the body): review {__name__}"
        )
    del body[found[0]]
    return tree


def any_scheduled_k_capture(method: Callable) -> Callable:
    return compile_rewrite(method, rewritten_source_tree(method))


def install() -> None:
    from vllm_nemotron_spec.patches import replace_when_imported

    replace_when_imported(
        __name__.rsplit(".", 1)[-1],
        TARGET_MODULE,
        TARGET_CLASS,
        TARGET_METHOD,
        any_scheduled_k_capture,
    )
