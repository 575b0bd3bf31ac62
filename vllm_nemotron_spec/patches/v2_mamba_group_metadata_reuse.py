"""Patch: the target's Mamba layers build their attention metadata once a step, not once per group.

Why:     vLLM's hybrid KV-cache manager splits the Lightning target's 23 Mamba layers into four
         KV-cache groups (and the tiny family's six into three). Model runner V2's
         ``build_attn_metadata`` gives every later group of the same ``MambaSpec`` a copy of the
         first group's metadata with its own state indices (``update_block_table``), but only
         where the builder says ``supports_update_block_table``; the Mamba builder turns that off
         whenever speculative decoding is on, so each group runs the whole ``build``: ~20 small
         CPU tensor ops and a few ``.item()`` reads each, every step. py-spy on an H200 put
         ``Mamba2AttentionMetadataBuilder.build`` at ~22% (~1 ms) of a one-request DSpark step
         whose host work outlasted its GPU work (``benchmarks/RESULTS.md``).
How:     ``Mamba2AttentionMetadataBuilder.__init__`` is wrapped: after upstream's, a builder turns
         ``supports_update_block_table`` back on when :func:`shares_group_metadata` holds (model
         runner V2 on CUDA, a draft the plugin routed, no ReplaySSM or RecoverSSM, the patch fully
         installed, ``NEMOTRON_SPEC_MAMBA_METADATA_REUSE`` not ``0``). Nothing else changes:
         upstream's own ``update_block_table`` re-gathers the group's state indices from its block
         table and stages them, and the accepted counts, into the group's own graph buffers, as a
         ``build`` of its own would; every other field depends on the batch, not the group
         (the targets below are the code that says so). MRV2 takes the same path at graph
         capture, so a replayed graph reads the buffers it captured.
Upstream: not reported yet (docs/upstream.md); vLLM's GDN builder already does this on V2 only,
         where capture reuses metadata too.
Removal: when upstream's Mamba builder shares batch-level metadata under speculative decoding.
         ``tests/patches/test_v2_mamba_group_metadata_reuse.py`` pins the code relied on
         (tripwire) and compares, on vLLM's own ``build_attn_metadata``, every field of every
         group with and without the reuse (decode, mixed and prefill batches, both Mamba cache
         modes, at capture and at run time); ``tests/gpu/`` serves with it, tokens equal to
         plain decoding's.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

from vllm_nemotron_spec.patches import Target

NAME = __name__.rsplit(".", 1)[-1]
ENV = "NEMOTRON_SPEC_MAMBA_METADATA_REUSE"  # "0": every group builds its own (A/B measurements)
MARK = "nemotron_spec_shares_group_metadata"  # set on a builder that reuses (facts, tests)

BUILDER_MODULE = "vllm.v1.attention.backends.mamba2_attn"
BUILDER_CLASS = "Mamba2AttentionMetadataBuilder"
BASE_MODULE = "vllm.v1.attention.backends.mamba_attn"
TARGETS = (
    # replaced: the wrapper turns the reuse back on after upstream's __init__ turned it off
    Target(
        BUILDER_MODULE,
        f"{BUILDER_CLASS}.__init__",
        {"e29a04f0b7e61e3e": "0.32.0, 0.33.0"},
    ),
    # relied on: what build adds to the common metadata (batch-level prefill chunks, and the
    # checkpoints the update re-gathers per group)
    Target(
        BUILDER_MODULE,
        f"{BUILDER_CLASS}.build",
        {"65224d3db0d1e277": "0.32.0, 0.33.0"},
    ),
    Target(
        BUILDER_MODULE,
        f"{BUILDER_CLASS}.update_block_table",
        {"7e76b6d9dc108e4d": "0.32.0, 0.33.0"},
    ),
    # relied on: spec decode is why __init__ turns the reuse off; only the state indices come
    # from the group's block table; the update stages what build stages
    Target(
        BASE_MODULE,
        "BaseMambaAttentionMetadataBuilder.__init__",
        {"4ad5a1aba64210ef": "0.32.0, 0.33.0"},
    ),
    Target(
        BASE_MODULE,
        "BaseMambaAttentionMetadataBuilder._compute_common_metadata",
        {"a7339964b1c1e8f0": "0.32.0, 0.33.0"},
    ),
    Target(
        BASE_MODULE,
        "BaseMambaAttentionMetadataBuilder._update_metadata_for_cudagraph_capture",
        {"27995bdffa87b469": "0.32.0, 0.33.0"},
    ),
    Target(
        BASE_MODULE,
        "BaseMambaAttentionMetadataBuilder.update_block_table",
        {"830fa2d4f13f4508": "0.32.0, 0.33.0"},
    ),
    # relied on: a prefill row's checkpoint destinations, re-gathered from the group's table
    Target(
        "vllm.model_executor.layers.mamba.checkpoint",
        "MambaPrefillCheckpointMetadata.regather_state_indices",
        {"c8fdb87c8d5c268b": "0.32.0, 0.33.0"},
    ),
    # relied on: MRV2 reuses by (spec, builder type), at capture too, and every Mamba group
    # gets the same batch-level arguments
    Target(
        "vllm.v1.worker.gpu.attn_utils",
        "build_attn_metadata",
        {"1cd980dad1ec26cf": "0.32.0, 0.33.0"},
    ),
    Target(
        "vllm.v1.worker.gpu.model_states.mamba_hybrid",
        "MambaHybridAttnMetadata.get_extra_common_attn_kwargs",
        {"84830673afc3d970": "0.32.0, 0.33.0"},
    ),
    Target(
        "vllm.v1.worker.gpu.model_states.mamba_hybrid",
        "MambaHybridAttnMetadata.get_extra_attn_kwargs",
        {"1c1ff2043015ed6d": "0.32.0, 0.33.0"},
    ),
)


def shares_group_metadata(builder: Any, vllm_config: Any, device: Any) -> bool:
    """Whether this Mamba2 builder may take a first group's metadata and re-gather its own state
    indices: the speculative case upstream leaves off, on the path this patch was checked for."""
    from vllm_nemotron_spec import patches
    from vllm_nemotron_spec.target_hook import routed_architecture

    cache_config = vllm_config.cache_config
    return (
        builder.use_spec_decode
        and not builder.supports_update_block_table
        and getattr(device, "type", None) == "cuda"
        and bool(getattr(vllm_config, "use_v2_model_runner", False))
        and not builder.use_replayssm
        and not getattr(cache_config, "use_kda_recoverssm", False)
        and routed_architecture(vllm_config.speculative_config) is not None
        and os.environ.get(ENV, "1") != "0"
        and patches.is_installed(NAME)
    )


def _is_vllms_class(builder: Any) -> bool:
    # not a subclass: one may keep per-group state in its metadata
    cls = type(builder)
    return (cls.__module__, cls.__qualname__) == (BUILDER_MODULE, BUILDER_CLASS)


_logged = False


def _log_once() -> None:
    global _logged
    if not _logged:
        _logged = True
        from vllm.logger import init_logger

        from vllm_nemotron_spec.target_hook import LOGGER_NAME

        init_logger(LOGGER_NAME).info(
            "nemotron-spec: the target's Mamba KV-cache groups share one metadata build a step "
            "(%s=0: one per group, as vLLM)",
            ENV,
        )


def _wrap_init(original: Callable) -> Callable:
    @functools.wraps(original)
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device, *args, **kwargs):
        original(self, kv_cache_spec, layer_names, vllm_config, device, *args, **kwargs)
        if _is_vllms_class(self) and shares_group_metadata(self, vllm_config, device):
            self.supports_update_block_table = True
            setattr(self, MARK, True)
            _log_once()

    return __init__


def install() -> None:
    from vllm_nemotron_spec.patches import check_when_imported, replace_when_imported

    for target in TARGETS[1:]:
        check_when_imported(NAME, target.module, target.qualname)
    replace_when_imported(NAME, BUILDER_MODULE, BUILDER_CLASS, "__init__", _wrap_init)
