"""Patch: the V2 DFlash/DSpark speculators prepare a decode step's draft inputs in ~60 us.

Why:     ``prepare_dflash_inputs`` (the V2 DFlash speculator, which DSpark's extends) launches one
         Triton program per request whose tile is ``BLOCK_SIZE = min(256, next_power_of_2(the
         longest request's target tokens + query rows))``: 8 lanes for a DSpark 3 decode step. The
         last request's program also pads the graph buffers up to ``max_num_tokens`` (16,384 for
         an offline engine) in tiles of that size: ~2,000 serial iterations, measured on an H100
         at 0.062 ms per step at concurrency 1 and 16 alike, 1.4% of a DSpark 3 step on the NVFP4
         Lightning target (``benchmarks/RESULTS.md``).
How:     the launcher is upstream's function with that one assignment rewritten to the widest
         tile, :data:`WIDE_BLOCK` (256, the tile upstream already uses for long prefill chunks):
         every store of the kernel is masked by its row range, so the outputs are the same and
         the padding loops run 64 iterations. Nothing else changes; where the assignment is not
         found the patch is not installed and vLLM's launcher runs (a speed patch: nothing
         refuses).
Upstream: not reported yet; vllm-ascend's own launcher vectorises the same padding (its PR #14499).
Removal: when upstream pads with a tile independent of the batch's shape.
         ``tests/patches/test_v2_dflash_inputs_block.py`` pins the assignment (tripwire) and
         compares the launches; ``tests/gpu/test_gpu_dflash_inputs_block.py`` compares every
         output buffer on a GPU.
"""

from __future__ import annotations

import ast
from typing import Callable

from vllm_nemotron_spec.patches import RewriteMismatch, Target, compile_rewrite, source_tree

TARGET_MODULE = "vllm.v1.worker.gpu.spec_decode.dflash.speculator"
TARGET_FUNCTION = "prepare_dflash_inputs"
TARGETS = (
    Target(
        TARGET_MODULE,
        TARGET_FUNCTION,
        {"55bac3e91aee67b3": "0.32.0", "9d923624d163f8bb": "0.33.0"},
    ),
)

WIDE_BLOCK = 256
# Upstream's tile choice, identical in vLLM 0.32.0 and 0.33.0; compared as an AST.
UPSTREAM_BLOCK = "BLOCK_SIZE = min(256, triton.next_power_of_2(max(1, max_tokens_per_req)))"


def rewritten_source_tree(function: Callable) -> ast.Module:
    """The AST of ``function`` (vLLM's ``prepare_dflash_inputs``) with the tile assignment set
    to :data:`WIDE_BLOCK`; ``RewriteMismatch`` unless the assignment occurs exactly once."""
    tree = source_tree(function, TARGET_FUNCTION)
    expected = ast.dump(ast.parse(UPSTREAM_BLOCK).body[0])
    found = [n for n in ast.walk(tree) if isinstance(n, ast.Assign) and ast.dump(n) == expected]
    if len(found) != 1:
        raise RewriteMismatch(
            f"upstream's tile assignment found {len(found)} times in "
            f"{function.__code__.co_filename} (expected once): review {__name__}"
        )
    node = found[0]
    node.value = ast.copy_location(ast.Constant(WIDE_BLOCK), node.value)
    return tree


def wide_block_launcher(function: Callable) -> Callable:
    return compile_rewrite(function, rewritten_source_tree(function))


def install() -> None:
    from vllm_nemotron_spec.patches import replace_when_imported

    replace_when_imported(
        __name__.rsplit(".", 1)[-1], TARGET_MODULE, None, TARGET_FUNCTION, wide_block_launcher
    )
