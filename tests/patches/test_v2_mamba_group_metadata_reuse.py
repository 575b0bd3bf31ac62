"""Tripwire and oracle for the Mamba metadata shared between KV-cache groups under speculative
decoding: vLLM's own ``build_attn_metadata`` (model runner V2), run on real Mamba2 builders of
three groups with different block tables (``benchmarks/harness/mamba_groups.py``), gives every
layer the same metadata, field by field, whether the later groups re-gather from the first
group's (the patch) or build their own (upstream); each group's staged state indices and
accepted counts live in its own graph buffers, at capture and at run time alike; and only the
first group builds."""

from __future__ import annotations

import importlib
import types

import numpy as np
import pytest
import torch

from benchmarks.harness import mamba_groups as mg
from vllm_nemotron_spec import patches
from vllm_nemotron_spec.patches import v2_mamba_group_metadata_reuse as patch

K, GROUPS = 3, 3
CPU = torch.device("cpu")


def test_every_relied_on_symbol_is_the_checked_code():
    for target in patch.TARGETS:
        obj = patches._lookup(importlib.import_module(target.module), target.qualname)
        needed, versions = patches.check_target(target, getattr(obj, "__wrapped__", obj))
        assert needed and "0.32.0" in versions, target.where


@pytest.fixture(scope="module", params=["none", "align"])
def config(request, tiny_family):
    return mg.engine_config(tiny_family.target, tiny_family.dspark_draft, request.param, K)


def test_upstream_turns_the_sharing_off_under_speculative_decoding(config):
    (group,) = mg.groups(config, 1, share=False, device=CPU)
    builder = mg.builder_of(group)
    assert builder.use_spec_decode and builder.supports_update_block_table is False


@pytest.mark.parametrize("kind", ["decode", "decodes-padded", "mixed", "prefill"])
@pytest.mark.parametrize("seed", [0, 1])
def test_shared_metadata_equals_each_groups_own_build(config, kind, seed):
    rng = np.random.default_rng(seed)
    b = mg.batch(kind, K, rng)
    tables = mg.block_tables(config, GROUPS, len(b.query_lens), rng, CPU)
    shared_groups = mg.groups(config, GROUPS, share=True, device=CPU)
    own_groups = mg.groups(config, GROUPS, share=False, device=CPU)
    shared = mg.metadata(shared_groups, b, tables, CPU)
    own = mg.metadata(own_groups, b, tables, CPU)
    assert shared.keys() == own.keys() and len(shared) == 2 * GROUPS
    bad = [d for name in own for d in mg.differences(shared[name], own[name], name)]
    assert not bad, bad
    # the later groups took the first group's metadata: one build a step, not three
    assert [mg.builder_of(g).builds for g in shared_groups] == [1, 0, 0]
    assert [mg.builder_of(g).builds for g in own_groups] == [1, 1, 1]
    # each group's state indices are its own table's (what a missing re-gather would lose)
    first = [shared[f"mamba.{g}.a"] for g in range(GROUPS)]
    if not b.prefilling[0]:
        rows = {str(m.state_indices_tensor_d[:1].tolist()) for m in first}
        assert len(rows) == GROUPS, rows
    if any(b.prefilling):
        rows = {str(m.state_indices_tensor_p.tolist()) for m in first}
        assert len(rows) == GROUPS, rows


def _staged_pointers(metadata: dict, groups) -> list[tuple[int, int]]:
    """(state indices, accepted counts) pointers of each group's first layer, asserted to be that
    group's own graph buffers."""
    out = []
    for g, group in enumerate(groups):
        builder, m = mg.builder_of(group), metadata[f"mamba.{g}.a"]
        assert m.state_indices_tensor_d.data_ptr() == builder.state_indices_tensor_d.data_ptr()
        assert m.num_accepted_tokens.data_ptr() == builder.decode_num_accepted_tokens.data_ptr()
        out.append((m.state_indices_tensor_d.data_ptr(), m.num_accepted_tokens.data_ptr()))
    return out


@pytest.mark.parametrize("num_reqs", [1, 4])
def test_a_replayed_graph_reads_the_buffers_it_captured(config, num_reqs):
    """MRV2 reuses metadata at capture as at run time: every group's captured state indices and
    accepted counts are its own builder's buffers, the ones a run-time step writes."""
    rng = np.random.default_rng(num_reqs)
    groups = mg.groups(config, GROUPS, share=True, device=CPU)
    tables = mg.block_tables(config, GROUPS, num_reqs, rng, CPU)
    capture = mg.Batch([1 + K] * num_reqs, [1 + K] * num_reqs, [False] * num_reqs, [1] * num_reqs)
    captured = _staged_pointers(mg.metadata(groups, capture, tables, CPU, capture=True), groups)
    step = mg.batch("decode", K, rng, n=num_reqs)
    replayed = _staged_pointers(mg.metadata(groups, step, tables, CPU), groups)
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
        dict(device=CPU),
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


def test_the_installed_wrapper_turns_the_sharing_on_and_marks_the_builder(config, monkeypatch):
    """Where the decision holds (on this CPU machine only when faked: it needs CUDA and model
    runner V2) vLLM's builder shares and is marked; a subclass of it is left alone."""
    from vllm.v1.attention.backends.mamba2_attn import Mamba2AttentionMetadataBuilder

    from vllm_nemotron_spec.plugin import register

    register()
    patches.require("the test", patch.NAME)
    assert getattr(Mamba2AttentionMetadataBuilder.__init__, "_nemotron_spec_patch", False)
    seen, said = [], []
    monkeypatch.setattr(patch, "shares_group_metadata", lambda b, c, d: seen.append(d) or True)
    monkeypatch.setattr(patch, "_logged", False)
    monkeypatch.setattr("vllm.logger.init_logger", lambda name: types.SimpleNamespace(
        info=lambda msg, *a: said.append((name, msg % a))))  # fmt: skip
    spec = mg.mamba_spec(config)
    builder = Mamba2AttentionMetadataBuilder(spec, ["m"], config, CPU)
    assert seen == [CPU] and builder.supports_update_block_table
    assert getattr(builder, patch.MARK, False)
    Mamba2AttentionMetadataBuilder(spec, ["m2"], config, CPU)  # logged once a process
    assert [(name, msg.split(" (")[0]) for name, msg in said] == [
        ("vllm.nemotron_spec.target", "nemotron-spec: the target's Mamba KV-cache groups share one "
         "metadata build a step")
    ]  # fmt: skip

    class Subclass(Mamba2AttentionMetadataBuilder):
        pass

    other = Subclass(spec, ["m"], config, CPU)
    assert not other.supports_update_block_table and not getattr(other, patch.MARK, False)
