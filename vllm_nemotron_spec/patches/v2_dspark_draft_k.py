"""Patch: under a per-batch-size schedule, a DSpark step drafts only the k tokens it verifies.

Why:     vLLM 0.33's DFlash/DSpark speculator sizes its query pass once, from
         ``num_speculative_tokens``: under ``num_speculative_tokens_per_batch_size`` every step
         runs the draft's layers, lm_head and Markov walk over the whole block, and the runner
         then masks the drafts past the step's k (``draft_tokens[:, k:] = -1``). On an H100 with
         the NVFP4 Lightning target (DSpark block 7, 64 requests) the schedule's k = 3 took
         20.33 ms a step against 19.58 for an engine serving k = 3 alone (docs/upstream.md,
         entry 23).
How:     for each k of the schedule between 0 and the block, the speculator gets a second
         *layout*: the query tokens a request sends (``k``, or ``1 + k`` without
         ``sample_from_anchor``), the sampled positions' columns, the anchors' rows and a CUDA
         graph manager for that query length, captured after the block's graphs with the layout
         in place. ``propose`` swaps in the layout of the k the runner passes (the k it verifies
         next) and restores the block's after. Everything else (buffers sized for the block, the
         context store, the fused Markov walk) reads these attributes, so a k step runs the
         block's code on k positions. Only Nemotron 3.5 DSpark drafts (the plugin's draft model;
         every other draft keeps vLLM's path): their block attention is causal, so the first
         k drafts are the block's (acceptance unchanged, tokens exact); DFlash attends across
         its block and keeps vLLM's whole-block drafting. Not under data parallelism (vLLM
         serves ``num_speculative_tokens`` there).
Upstream: not reported yet (docs/upstream.md, entry 23).
Removal: when vLLM's speculator drafts the step's k itself.
         ``tests/patches/test_v2_dspark_draft_k.py`` pins the methods (tripwire) and checks the
         swap on a stand-in speculator; ``tests/gpu/test_gpu_batch_size_schedule.py`` serves
         schedules with CUDA graphs, tokens equal to plain decoding's.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable

from vllm_nemotron_spec.patches import Target

NAME = __name__.rsplit(".", 1)[-1]
DFLASH_MODULE = "vllm.v1.worker.gpu.spec_decode.dflash.speculator"
DSPARK_MODULE = "vllm.v1.worker.gpu.spec_decode.dspark.speculator"
RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"
_BOTH = "0.32.0, 0.33.0"
REPLACED = ("init_cudagraph_manager", "capture", "propose")  # on DSparkSpeculator (inherited)
TARGETS = (
    Target(DSPARK_MODULE, "DSparkSpeculator.init_cudagraph_manager", {"44d0e420d3ae0889": _BOTH}),
    Target(DSPARK_MODULE, "DSparkSpeculator.capture", {"7ac105de34c066f3": _BOTH}),
    Target(
        DSPARK_MODULE,
        "DSparkSpeculator.propose",
        {"59e476c29badb197": "0.33.0", "3f50f6dde60d4eb8": "0.32.0"},
    ),
    # relied on: they read the swapped attributes ...
    Target(DSPARK_MODULE, "DSparkSpeculator.__init__", {"887c11adc2937322": _BOTH}),
    Target(
        DSPARK_MODULE,
        "DSparkSpeculator._sample_sequential",
        {"f977418c074dd4a6": "0.33.0", "93d1a0ca6786800b": "0.32.0"},
    ),
    Target(DSPARK_MODULE, "DSparkSpeculator._generate_draft", {"b51f7bb532f7b207": _BOTH}),
    Target(
        DFLASH_MODULE, "DFlashSpeculator._num_graph_context_tokens", {"18b5e49ce1722ef7": _BOTH}
    ),
    # ... and the runner masks the drafts past the step's k before verification
    Target(
        RUNNER_MODULE,
        "GPUModelRunner.sample_tokens",
        {"f9f2f029dc4ffee6": "0.33.0", "e449ef5c753d9bed": "0.32.0"},
    ),
)
RELIED_ON = [t for t in TARGETS if t.qualname.rsplit(".", 1)[-1] not in REPLACED]

LAYOUTS = "_nemotron_spec_draft_k_layouts"
"""The speculator attribute holding ``{k: layout}`` (empty: the patch does nothing here)."""

SWAPPED = (
    "num_speculative_steps",
    "num_query_per_req",
    "query_cudagraph_manager",
    "sample_col",
    "_step_cols",
    "_anchor_idx",
)
"""What :func:`layout_of` swaps: every attribute the draft step reads its block size from (a
layout holds all but the graph manager, which is read from :func:`manager_attr`)."""


def layout_ks(speculator: Any) -> list[int]:
    """The k of the schedule that get their own layout: strictly between 0 (no query pass) and
    the block; only for a Nemotron 3.5 DSpark draft (the plugin's draft model, its validated
    config causal), none with a confidence head, without a schedule or under data
    parallelism: every other draft keeps vLLM's path."""
    draft = getattr(getattr(speculator, "model", None), "draft_spec", None)
    if draft is None or not draft.causal or speculator.requires_non_causal:
        return []
    spec = speculator.vllm_config.speculative_config
    ranges = getattr(spec, "num_speculative_tokens_per_batch_size", None) or ()
    if not ranges or getattr(speculator, "dp_size", 1) > 1:
        return []
    if getattr(speculator, "use_confidence_head", False):
        return []  # its confidences are stored [requests, block] in one assignment
    block = speculator.num_speculative_steps
    return sorted({int(k) for _, _, k in ranges if 0 < int(k) < block})


def block_layout(speculator: Any) -> dict:
    return {name: getattr(speculator, name) for name in SWAPPED}


def manager_attr(k: int) -> str:
    """The speculator attribute holding layout ``k``'s CUDA graph manager. A manager must be an
    attribute of its own: vLLM's graph-memory profiling drops every ``CudaGraphManager`` it finds
    in ``vars(speculator)`` (their graphs live in a throwaway pool) before the real start-up
    builds them again."""
    return f"_nemotron_spec_draft_k{k}_cudagraph_manager"


def bare_layout(speculator: Any, k: int) -> dict:
    """Layout ``k``; its CUDA graph manager is read from :func:`manager_attr` when swapped in."""
    import torch

    device = speculator.device
    per_req = k if speculator.sample_from_anchor else 1 + k
    steps = torch.arange(k, dtype=torch.int32, device=device)
    return {
        "num_speculative_steps": k,
        "num_query_per_req": per_req,
        "sample_col": steps.repeat(speculator.max_num_reqs),
        "_step_cols": steps.clone(),
        # each request's anchor: the first query row of its block of per_req
        "_anchor_idx": torch.arange(speculator.max_num_reqs, dtype=torch.int64, device=device)
        * per_req,
    }


@contextmanager
def layout_of(speculator: Any, layout: dict):
    """``layout`` in place for the duration; the previous one restored after, also on error."""
    before = block_layout(speculator)
    for name, value in layout.items():
        setattr(speculator, name, value)
    # None while init_cudagraph_manager builds it
    manager = getattr(speculator, manager_attr(layout["num_speculative_steps"]), None)
    speculator.query_cudagraph_manager = manager
    try:
        yield
    finally:
        for name, value in before.items():
            setattr(speculator, name, value)


def per_k_init_cudagraph_manager(original: Callable) -> Callable:
    def init_cudagraph_manager(self, cudagraph_mode):
        original(self, cudagraph_mode)
        layouts = {}
        for k in layout_ks(self):
            layout = bare_layout(self, k)
            with layout_of(self, layout):
                original(self, cudagraph_mode)  # a manager for k's query length
                setattr(self, manager_attr(k), self.query_cudagraph_manager)
            layouts[k] = layout
        setattr(self, LAYOUTS, layouts)

    return init_cudagraph_manager


def per_k_capture(original: Callable) -> Callable:
    def capture(self):
        original(self)
        for k, layout in sorted(getattr(self, LAYOUTS, {}).items()):
            with layout_of(self, layout):  # the graphs record k's shapes and slices
                original(self)

    return capture


def per_k_propose(original: Callable) -> Callable:
    def propose(self, *args, **kwargs):
        layout = getattr(self, LAYOUTS, {}).get(kwargs.get("num_speculative_tokens"))
        if layout is None:
            return original(self, *args, **kwargs)
        with layout_of(self, layout):
            # draft_tokens keeps the block's width: columns past k are stale, and the runner
            # masks them (draft_tokens[:, k:] = -1) before they reach verification
            return original(self, *args, **kwargs)

    return propose


def install() -> None:
    from vllm_nemotron_spec.patches import check_when_imported, replace_when_imported

    for target in RELIED_ON:
        check_when_imported(NAME, target.module, target.qualname)
    makers = (per_k_init_cudagraph_manager, per_k_capture, per_k_propose)
    for attr, make in zip(REPLACED, makers):
        replace_when_imported(NAME, DSPARK_MODULE, "DSparkSpeculator", attr, make)
