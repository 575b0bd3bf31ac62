"""Tripwire and oracle for the Mamba metadata shared between KV-cache groups under speculative
decoding: vLLM's own ``build_attn_metadata`` (model runner V2), run on real Mamba2 builders of
three groups with different block tables, gives every layer the same metadata, field by field,
whether the later groups re-gather from the first group's (the patch) or build their own
(upstream); each group's staged state indices and accepted counts live in its own graph buffers,
at capture and at run time alike; and only the first group builds."""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest
import torch

from vllm_nemotron_spec import patches
from vllm_nemotron_spec.patches import v2_mamba_group_metadata_reuse as patch

K, GROUPS, BLOCK, MAX_LEN, MAX_SEQS = 3, 3, 16, 512, 16


def test_every_relied_on_symbol_is_the_checked_code():
    import importlib

    for target in patch.TARGETS:
        module = importlib.import_module(target.module)
        obj = patches._lookup(module, target.qualname)
        needed, versions = patches.check_target(target, getattr(obj, "__wrapped__", obj))
        assert needed and "0.32.0" in versions, target.where


@pytest.fixture(scope="module", params=["none", "align"])
def config(request, tiny_family):
    """The tiny target with its routed DSpark draft (k = 3) and full CUDA graphs (the staging
    path), in the Mamba cache mode of the parameter."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.engine.arg_utils import EngineArgs

    patches.apply_one("nemotron_h_config_hook")
    config = EngineArgs(
        model=str(tiny_family.target),
        skip_tokenizer_init=True,
        max_model_len=MAX_LEN,
        max_num_seqs=MAX_SEQS,
        enable_prefix_caching=request.param == "align",
        speculative_config={
            "method": "dspark",
            "model": str(tiny_family.dspark_draft),
            "num_speculative_tokens": K,
        },
    ).create_engine_config()
    assert config.cache_config.mamba_cache_mode == request.param
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    return config


def _spec(config):
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(
        block_size=BLOCK,
        shapes=((3, 8), (2, 4, 4)),
        dtypes=(torch.float32, torch.float32),
        mamba_cache_mode=config.cache_config.mamba_cache_mode,
        num_speculative_blocks=K,
    )


def _groups(config, share: bool):
    """Three Mamba groups of one spec, a builder each (on CPU: the patch itself leaves them
    alone here, so ``share`` sets what it would)."""
    from vllm.v1.attention.backends.mamba2_attn import (
        Mamba2AttentionBackend,
        Mamba2AttentionMetadataBuilder,
    )
    from vllm.v1.worker.utils import AttentionGroup

    spec, groups = _spec(config), []
    for g in range(GROUPS):
        names = [f"mamba.{g}.a", f"mamba.{g}.b"]
        builder = Mamba2AttentionMetadataBuilder(spec, names, config, torch.device("cpu"))
        assert builder.supports_update_block_table is False  # upstream, under spec decode
        builder.supports_update_block_table = share
        builder.builds = 0
        build = builder.build

        def counted(*args, _build=build, _builder=builder, **kwargs):
            _builder.builds += 1
            return _build(*args, **kwargs)

        builder.build = counted
        groups.append(
            [AttentionGroup(Mamba2AttentionBackend, names, spec, g, metadata_builders=[builder])]
        )
    return groups


@dataclasses.dataclass
class Batch:
    query_lens: list[int]  # decodes (1 + K rows), then prefills; 0 = a graph's padding row
    seq_lens: list[int]
    prefilling: list[bool]
    accepted: list[int]


def _batch(kind: str, rng) -> Batch:
    def decodes(n):
        return [1 + K] * n, list(rng.integers(40, 300, n)), [False] * n

    if kind == "one-decode":
        q, s, p = decodes(1)
    elif kind == "decodes-padded":  # a graph's batch of 8 with 5 requests
        q, s, p = decodes(5)
        q, s, p = q + [0] * 3, s + [0] * 3, p + [False] * 3
    elif kind == "mixed":  # decodes, a one-token prompt tail, a later chunk, a first chunk
        q, s, p = decodes(3)
        q, s, p = q + [1, 37, 90], s + [121, 237, 90], p + [True] * 3
    else:  # prefill only
        q, s, p = [64, 9], [64, 200], [True, True]
    accepted = [int(rng.integers(1, K + 2)) if not pre and n else 1 for n, pre in zip(q, p)]
    return Batch(q, [int(x) for x in s], p, accepted)


def _metadata(config, groups, batch: Batch, tables, capture: bool = False) -> dict:
    """vLLM's ``build_attn_metadata`` as model runner V2's Mamba hybrid state calls it."""
    from vllm.v1.worker.gpu.attn_utils import build_attn_metadata
    from vllm.v1.worker.gpu.model_states.mamba_hybrid import MambaHybridAttnMetadata

    n = len(batch.query_lens)
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(batch.query_lens)]), dtype=torch.int32)
    num_tokens = int(qsl[-1])
    drafts = [K if not p and q else -1 for q, p in zip(batch.query_lens, batch.prefilling)]
    extra = MambaHybridAttnMetadata(
        is_prefilling=torch.tensor(batch.prefilling),
        num_accepted_tokens=None if capture else torch.tensor(batch.accepted, dtype=torch.int32),
        num_decode_draft_tokens_cpu=None if capture else torch.tensor(drafts, dtype=torch.int32),
    )
    seq_lens = torch.tensor(batch.seq_lens, dtype=torch.int32)
    return build_attn_metadata(
        attn_groups=groups,
        num_reqs=n,
        num_tokens=num_tokens,
        query_start_loc_gpu=qsl.clone(),
        query_start_loc_cpu=qsl,
        max_query_len=max(batch.query_lens),
        seq_lens=seq_lens.clone(),
        max_seq_len=MAX_LEN if capture else max(batch.seq_lens),
        block_tables=tables,
        slot_mappings=torch.zeros(GROUPS, max(num_tokens, 1), dtype=torch.int64),
        kv_cache_config=types.SimpleNamespace(kv_cache_groups=[None] * GROUPS),
        seq_lens_cpu_upper_bound=seq_lens,
        model_specific_attn_metadata=extra,
        for_cudagraph_capture=capture,
    )


def _tables(config, n: int, rng) -> list[torch.Tensor]:
    """A block table per group, no two groups alike (a group given another's indices shows)."""
    cols = 1 + K if config.cache_config.mamba_cache_mode == "none" else MAX_LEN // BLOCK + K
    return [
        torch.tensor(rng.permutation(5000)[: n * cols].reshape(n, cols) + 1, dtype=torch.int32)
        for _ in range(GROUPS)
    ]


def _differences(a, b, where: str) -> list[str]:
    if dataclasses.is_dataclass(a):
        assert type(a) is type(b), where
        return [
            d
            for f in dataclasses.fields(a)
            for d in _differences(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
        ]
    if isinstance(a, torch.Tensor):
        same = (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
        return [] if same else [f"{where}: {a} != {b}"]
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return [f"{where}: keys {a} != {b}"]
        return [d for k in a for d in _differences(a[k], b[k], f"{where}[{k!r}]")]
    if isinstance(a, (tuple, list)):
        if not isinstance(b, type(a)) or len(a) != len(b):
            return [f"{where}: {a} != {b}"]
        return [
            d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{where}[{i}]")
        ]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


@pytest.mark.parametrize("kind", ["one-decode", "decodes-padded", "mixed", "prefill"])
@pytest.mark.parametrize("seed", [0, 1])
def test_shared_metadata_equals_each_groups_own_build(config, kind, seed):
    rng = np.random.default_rng(seed)
    batch = _batch(kind, rng)
    tables = _tables(config, len(batch.query_lens), rng)
    shared_groups, own_groups = _groups(config, share=True), _groups(config, share=False)
    shared = _metadata(config, shared_groups, batch, tables)
    own = _metadata(config, own_groups, batch, tables)
    assert shared.keys() == own.keys() and len(shared) == 2 * GROUPS
    bad = [d for name in own for d in _differences(shared[name], own[name], name)]
    assert not bad, bad
    # the later groups took the first group's metadata: one build a step, not three
    assert [g[0].get_metadata_builder(0).builds for g in shared_groups] == [1, 0, 0]
    assert [g[0].get_metadata_builder(0).builds for g in own_groups] == [1, 1, 1]
    # each group's state indices are its own table's (what a wrong re-gather would lose)
    first_slots = {
        g: (shared[f"mamba.{g}.a"].state_indices_tensor_d.tolist() or [None])[0] for g in range(3)
    }
    if not batch.prefilling[0]:
        assert len({str(v) for v in first_slots.values()}) == GROUPS, first_slots
    first_prefill = {g: shared[f"mamba.{g}.a"].state_indices_tensor_p.tolist() for g in range(3)}
    if any(batch.prefilling):
        assert len({str(v) for v in first_prefill.values()}) == GROUPS, first_prefill


def _staged_pointers(metadata: dict, groups) -> list[tuple[int, int]]:
    """(state indices, accepted counts) pointers of each group's first layer, asserted to be that
    group's own graph buffers."""
    out = []
    for g, group in enumerate(groups):
        builder = group[0].get_metadata_builder(0)
        m = metadata[f"mamba.{g}.a"]
        assert m.state_indices_tensor_d.data_ptr() == builder.state_indices_tensor_d.data_ptr()
        assert m.num_accepted_tokens.data_ptr() == builder.decode_num_accepted_tokens.data_ptr()
        out.append((m.state_indices_tensor_d.data_ptr(), m.num_accepted_tokens.data_ptr()))
    return out


@pytest.mark.parametrize("num_reqs", [1, 4])
def test_a_replayed_graph_reads_the_buffers_it_captured(config, num_reqs):
    """MRV2 reuses metadata at capture as at run time: every group's captured state indices and
    accepted counts are its own builder's buffers, the ones a run-time step writes."""
    rng = np.random.default_rng(num_reqs)
    groups = _groups(config, share=True)
    capture = Batch([1 + K] * num_reqs, [MAX_LEN] * num_reqs, [False] * num_reqs, [1] * num_reqs)
    tables = _tables(config, num_reqs, rng)
    captured = _staged_pointers(_metadata(config, groups, capture, tables, capture=True), groups)
    step = _batch("one-decode", rng) if num_reqs == 1 else _batch("decodes-padded", rng)
    step = dataclasses.replace(
        step,
        query_lens=step.query_lens[:num_reqs],
        seq_lens=step.seq_lens[:num_reqs],
        prefilling=step.prefilling[:num_reqs],
        accepted=step.accepted[:num_reqs],
    )
    replayed = _staged_pointers(_metadata(config, groups, step, tables), groups)
    assert captured == replayed
    assert len({p for pair in replayed for p in pair}) == 2 * GROUPS


def _decision_inputs(config, **changes):
    builder = types.SimpleNamespace(
        use_spec_decode=True, supports_update_block_table=False, use_replayssm=False
    )
    vllm_config = types.SimpleNamespace(
        cache_config=config.cache_config,
        speculative_config=config.speculative_config,
        use_v2_model_runner=True,
    )
    device = torch.device("cuda")
    for key, value in changes.items():
        if key == "device":
            device = value
        elif hasattr(builder, key):
            setattr(builder, key, value)
        else:
            setattr(vllm_config, key, value)
    return builder, vllm_config, device


@pytest.mark.parametrize(
    "change",
    [
        dict(device=torch.device("cpu")),
        dict(use_v2_model_runner=False),
        dict(use_spec_decode=False),
        dict(supports_update_block_table=True),  # upstream shares already (no draft)
        dict(use_replayssm=True),
        dict(cache_config=types.SimpleNamespace(use_kda_recoverssm=True)),
        dict(speculative_config=types.SimpleNamespace(method="ngram")),
        dict(env="0"),
    ],
    ids=lambda c: next(iter(c)),
)
def test_shared_only_on_the_checked_path(config, monkeypatch, change):
    from vllm_nemotron_spec.plugin import register

    register()
    patches.require("the test", patch.NAME)  # installed on this vLLM (its modules imported)
    monkeypatch.delenv(patch.ENV, raising=False)
    assert patch.shares_group_metadata(*_decision_inputs(config))
    change = dict(change)
    if "env" in change:
        monkeypatch.setenv(patch.ENV, change.pop("env"))
    assert not patch.shares_group_metadata(*_decision_inputs(config, **change))


def test_the_builder_of_a_routed_draft_shares_on_cuda(config, monkeypatch):
    """The installed wrapper turns the reuse on (and marks the builder) where the decision
    holds, which on this CPU machine needs a CUDA device object and model runner V2."""
    from vllm.v1.attention.backends.mamba2_attn import Mamba2AttentionMetadataBuilder

    from vllm_nemotron_spec.plugin import register

    register()
    patches.require("the test", patch.NAME)
    assert getattr(Mamba2AttentionMetadataBuilder.__init__, "_nemotron_spec_patch", False)
    seen = []
    monkeypatch.setattr(
        patch, "shares_group_metadata", lambda b, c, d: seen.append(d.type) or d.type == "cpu"
    )
    builder = Mamba2AttentionMetadataBuilder(_spec(config), ["m"], config, torch.device("cpu"))
    assert seen == ["cpu"] and builder.supports_update_block_table
    assert getattr(builder, patch.MARK, False)
