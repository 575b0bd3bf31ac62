"""vLLM's own ``build_attn_metadata`` (model runner V2) on real Mamba2 builders of several
KV-cache groups, as the Nemotron target's Mamba hybrid state calls it each step: each group
building its own metadata (upstream under speculative decoding) or the later groups sharing the
first group's (``patches/v2_mamba_group_metadata_reuse.py``). Used by the ``mamba-metadata``
scenario (host time, on CPU or CUDA) and by the patch's tests (field-by-field equality)."""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import torch

BLOCK = 16  # the Mamba block size of the groups built here
MAX_LEN, MAX_SEQS = 512, 16


def engine_config(target, draft, mode: str, k: int):
    """The tiny target's ``VllmConfig`` with its routed DSpark draft (``k`` drafted tokens) and
    full CUDA graphs (the graphs' staging path), in Mamba cache mode ``mode`` (none / align)."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.engine.arg_utils import EngineArgs

    from vllm_nemotron_spec import patches

    patches.apply_one("nemotron_h_config_hook")
    config = EngineArgs(
        model=str(target),
        skip_tokenizer_init=True,
        max_model_len=MAX_LEN,
        max_num_seqs=MAX_SEQS,
        enable_prefix_caching=mode == "align",
        speculative_config={"method": "dspark", "model": str(draft), "num_speculative_tokens": k},
    ).create_engine_config()
    if config.cache_config.mamba_cache_mode != mode:
        raise ValueError(f"asked for Mamba cache mode {mode}, vLLM chose {config.cache_config}")
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    return config


def k_of(config) -> int:
    return config.speculative_config.num_speculative_tokens


def mamba_spec(config):
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(
        block_size=BLOCK,
        shapes=((3, 8), (2, 4, 4)),
        dtypes=(torch.float32, torch.float32),
        mamba_cache_mode=config.cache_config.mamba_cache_mode,
        num_speculative_blocks=k_of(config),
    )


def groups(config, n: int, share: bool, device: torch.device) -> list:
    """``n`` Mamba groups of one spec, two layers and a builder each; ``share`` sets what the
    patch sets on a CUDA model runner V2 (``supports_update_block_table``). Each builder counts
    its ``build`` calls (``builds``)."""
    from vllm.v1.attention.backends.mamba2_attn import (
        Mamba2AttentionBackend,
        Mamba2AttentionMetadataBuilder,
    )
    from vllm.v1.worker.utils import AttentionGroup

    spec, out = mamba_spec(config), []
    for g in range(n):
        names = [f"mamba.{g}.a", f"mamba.{g}.b"]
        builder = Mamba2AttentionMetadataBuilder(spec, names, config, device)
        builder.supports_update_block_table = share
        builder.builds = 0
        build = builder.build

        def counted(*args, _build=build, _builder=builder, **kwargs):
            _builder.builds += 1
            return _build(*args, **kwargs)

        builder.build = counted
        group = AttentionGroup(Mamba2AttentionBackend, names, spec, g, metadata_builders=[builder])
        out.append([group])
    return out


def builder_of(group: list):
    return group[0].get_metadata_builder(0)


@dataclasses.dataclass
class Batch:
    query_lens: list[int]  # decodes (1 + k rows), then prefills; 0: a graph's padding row
    seq_lens: list[int]
    prefilling: list[bool]
    accepted: list[int]


def batch(kind: str, k: int, rng, n: int = 1) -> Batch:
    """``decode`` (``n`` requests), ``decodes-padded`` (a graph's batch of 8, 5 requests),
    ``mixed`` (decodes, a one-token prompt tail, a later and a first prompt chunk) or
    ``prefill``."""

    def decodes(m):
        return [1 + k] * m, [int(s) for s in rng.integers(40, 300, m)], [False] * m

    if kind == "decode":
        q, s, p = decodes(n)
    elif kind == "decodes-padded":
        q, s, p = decodes(5)
        q, s, p = q + [0] * 3, s + [0] * 3, p + [False] * 3
    elif kind == "mixed":
        q, s, p = decodes(3)
        q, s, p = q + [1, 37, 90], s + [121, 237, 90], p + [True] * 3
    elif kind == "prefill":
        q, s, p = [64, 9], [64, 200], [True, True]
    else:
        raise ValueError(f"unknown batch kind {kind!r}")
    accepted = [int(rng.integers(1, k + 2)) if not pre and m else 1 for m, pre in zip(q, p)]
    return Batch(q, s, p, accepted)


def block_tables(config, n_groups: int, n: int, rng, device) -> list[torch.Tensor]:
    """A block table per group, no two alike (a group given another's indices shows)."""
    k = k_of(config)
    cols = 1 + k if config.cache_config.mamba_cache_mode == "none" else MAX_LEN // BLOCK + k
    return [
        torch.tensor(rng.permutation(5000)[: n * cols].reshape(n, cols) + 1, dtype=torch.int32).to(
            device
        )
        for _ in range(n_groups)
    ]


def metadata(groups_: list, b: Batch, tables, device, capture: bool = False) -> dict:
    """Layer -> metadata from vLLM's ``build_attn_metadata``, called as the Mamba hybrid model
    state calls it (the CPU tensors on CPU, the rest on ``device``)."""
    from vllm.v1.worker.gpu.attn_utils import build_attn_metadata
    from vllm.v1.worker.gpu.model_states.mamba_hybrid import MambaHybridAttnMetadata

    k = builder_of(groups_[0]).num_spec_tokens
    n = len(b.query_lens)
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(b.query_lens)]), dtype=torch.int32)
    num_tokens = int(qsl[-1])
    drafts = [k if not p and q else -1 for q, p in zip(b.query_lens, b.prefilling)]
    extra = MambaHybridAttnMetadata(
        is_prefilling=torch.tensor(b.prefilling),
        num_accepted_tokens=None
        if capture
        else torch.tensor(b.accepted, dtype=torch.int32, device=device),
        num_decode_draft_tokens_cpu=None if capture else torch.tensor(drafts, dtype=torch.int32),
    )
    seq_lens = torch.tensor(b.seq_lens, dtype=torch.int32)
    return build_attn_metadata(
        attn_groups=groups_,
        num_reqs=n,
        num_tokens=num_tokens,
        query_start_loc_gpu=qsl.to(device),
        query_start_loc_cpu=qsl,
        max_query_len=max(b.query_lens),
        seq_lens=seq_lens.to(device),
        max_seq_len=MAX_LEN if capture else max(b.seq_lens),
        block_tables=tables,
        slot_mappings=torch.zeros(len(groups_), max(num_tokens, 1), dtype=torch.int64).to(device),
        kv_cache_config=types.SimpleNamespace(kv_cache_groups=[None] * len(groups_)),
        seq_lens_cpu_upper_bound=seq_lens,
        model_specific_attn_metadata=extra,
        for_cudagraph_capture=capture,
    )


def differences(a, b, where: str) -> list[str]:
    """Where two metadata objects differ: every dataclass field, tensors by dtype, shape and
    value."""
    if dataclasses.is_dataclass(a):
        if type(a) is not type(b):
            return [f"{where}: {type(a).__name__} != {type(b).__name__}"]
        return [
            d
            for f in dataclasses.fields(a)
            for d in differences(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
        ]
    if isinstance(a, torch.Tensor):
        same = (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.cpu(), b.cpu())
        )
        return [] if same else [f"{where}: {a} != {b}"]
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return [f"{where}: keys {a} != {b}"]
        return [d for key in a for d in differences(a[key], b[key], f"{where}[{key!r}]")]
    if isinstance(a, (tuple, list)):
        if not isinstance(b, type(a)) or len(a) != len(b):
            return [f"{where}: {a} != {b}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]
