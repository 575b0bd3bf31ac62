"""Tripwire for drafting only the step's k under a schedule (``patches/v2_dspark_draft_k.py``):
the speculator methods it wraps and the code it relies on are upstream's checked ones, and the
layout swap on a stand-in speculator (the real one needs CUDA: tests/gpu/)."""

from __future__ import annotations

import inspect
import types

import pytest
import torch

from vllm_nemotron_spec import patches
from vllm_nemotron_spec.patches import v2_dspark_draft_k as patch

SCHEDULE = [[1, 15, 7], [16, 63, 5], [64, 64, 3]]


def _upstream(target):
    import importlib

    obj = importlib.import_module(target.module)
    for part in target.qualname.split("."):
        obj = getattr(obj, part)
    return getattr(obj, "__wrapped__", obj)


@pytest.mark.parametrize("target", patch.TARGETS, ids=lambda t: t.qualname)
def test_upstream_code_is_the_checked_one(target):
    needed, versions = patches.check_target(target, _upstream(target))
    assert needed and versions


def test_the_swapped_attributes_are_what_the_draft_step_reads():
    """Each swapped attribute is read by the code that runs a k step; the runner masks the
    drafts past k, so the columns a k step leaves stale never reach verification."""
    by_name = {t.qualname.split(".")[-1]: inspect.getsource(_upstream(t)) for t in patch.TARGETS}
    assert "uniform_token_count=self.num_query_per_req" in by_name["propose"]
    assert "self.query_cudagraph_manager" in by_name["propose"]
    # DSpark's draft step: the backbone, then the walk, which stores drafts column by column
    assert "self._sample_sequential(num_reqs, head_hidden)" in by_name["_generate_draft"]
    assert "self.draft_tokens[:num_reqs, i] = draft_sampled_i" in by_name["_sample_sequential"]
    assert "self.num_speculative_steps" in by_name["_sample_sequential"]
    assert "self._anchor_idx[:num_reqs]" in by_name["_sample_sequential"]
    assert "* self.num_query_per_req" in by_name["__init__"]  # _anchor_idx's stride
    assert "decode_query_len=self.num_query_per_req" in by_name["init_cudagraph_manager"]
    assert "draft_tokens[:, num_spec_tokens:] = -1" in by_name["sample_tokens"]


class _Manager:
    def __init__(self, query_len):
        self.query_len, self.captured = query_len, []


class _Speculator:
    """What the patch touches of ``DSparkSpeculator``; its "upstream" methods record the
    layout they ran with."""

    def __init__(self, ranges=SCHEDULE, block=7, non_causal=False, from_anchor=False, dp=1):
        spec = types.SimpleNamespace(num_speculative_tokens_per_batch_size=ranges)
        self.vllm_config = types.SimpleNamespace(speculative_config=spec)
        self.requires_non_causal, self.sample_from_anchor, self.dp_size = (
            non_causal,
            from_anchor,
            dp,
        )
        # the plugin's Nemotron 3.5 draft model carries the validated draft config
        self.model = types.SimpleNamespace(draft_spec=types.SimpleNamespace(causal=not non_causal))
        self.device, self.max_num_reqs = torch.device("cpu"), 4
        self.num_speculative_steps = block
        self.num_query_per_req = block if from_anchor else 1 + block
        self.query_cudagraph_manager = None
        self.sample_col = torch.arange(block).repeat(4)
        self._step_cols = torch.arange(block)
        self._anchor_idx = torch.arange(4) * self.num_query_per_req
        self.seen = []

    def init_cudagraph_manager(self, mode):
        self.query_cudagraph_manager = _Manager(self.num_query_per_req)

    def capture(self):
        self.query_cudagraph_manager.captured.append(self.num_speculative_steps)

    def propose(self, *args, num_speculative_tokens=None, fail=False, **kwargs):
        self.seen.append((num_speculative_tokens, self.num_speculative_steps,
                          self.query_cudagraph_manager.query_len, len(self.sample_col)))  # fmt: skip
        if fail:
            raise RuntimeError("the draft step failed")
        return "drafts"


def _patched(**kwargs) -> _Speculator:
    speculator = _Speculator(**kwargs)
    for name, make in zip(patch.REPLACED, (patch.per_k_init_cudagraph_manager,
                                           patch.per_k_capture, patch.per_k_propose)):  # fmt: skip
        original = getattr(_Speculator, name)
        setattr(speculator, name, types.MethodType(make(original), speculator))
    speculator.init_cudagraph_manager("FULL")
    speculator.capture()
    return speculator


def test_layouts_are_the_schedules_k_between_0_and_the_block():
    assert patch.layout_ks(_Speculator()) == [3, 5]
    assert patch.layout_ks(_Speculator(ranges=[[1, 2, 4], [3, 8, 0], [9, 9, 4]], block=4)) == []
    assert patch.layout_ks(_Speculator(ranges=[(1, 1, 4), (2, 3, 2), (4, 8, 1)], block=4)) == [1, 2]
    assert patch.layout_ks(_Speculator(ranges=None)) == []
    assert patch.layout_ks(_Speculator(non_causal=True)) == []  # DFlash: drafts would differ
    assert patch.layout_ks(_Speculator(dp=2)) == []  # vLLM serves the block under DP
    other = _Speculator()
    other.model = types.SimpleNamespace()  # a DSpark draft that is not Nemotron 3.5's
    assert patch.layout_ks(other) == []
    confident = _Speculator()
    confident.use_confidence_head = True
    assert patch.layout_ks(confident) == []


@pytest.mark.parametrize("from_anchor", [False, True])
def test_each_k_gets_its_query_length_its_manager_and_its_captured_graphs(from_anchor):
    speculator = _patched(from_anchor=from_anchor)
    layouts = getattr(speculator, patch.LAYOUTS)
    assert sorted(layouts) == [3, 5]
    for k, layout in layouts.items():
        per_req = k if from_anchor else 1 + k
        manager = getattr(speculator, patch.manager_attr(k))  # vLLM's profiling can find it
        assert layout["num_query_per_req"] == manager.query_len == per_req
        assert manager.captured == [k]  # captured with k in place
        assert layout["sample_col"].tolist() == list(range(k)) * 4
        assert layout["_anchor_idx"].tolist() == [0, per_req, 2 * per_req, 3 * per_req]
    # the block's own layout is back in place, its graphs captured once
    assert speculator.num_speculative_steps == 7
    assert speculator.query_cudagraph_manager.captured == [7]
    assert speculator.query_cudagraph_manager.query_len == (7 if from_anchor else 8)


def test_propose_runs_the_layout_of_the_k_it_is_given_and_restores_the_block():
    speculator = _patched()
    assert speculator.propose(num_speculative_tokens=3) == "drafts"
    speculator.propose(num_speculative_tokens=7)
    speculator.propose(num_speculative_tokens=0)  # no query pass: vLLM's own early return
    speculator.propose(dummy_run=True)  # dummy runs pass no k: the block
    assert speculator.seen == [(3, 3, 4, 12), (7, 7, 8, 28), (0, 7, 8, 28), (None, 7, 8, 28)]
    with pytest.raises(RuntimeError, match="the draft step failed"):
        speculator.propose(num_speculative_tokens=5, fail=True)
    assert speculator.seen[-1] == (5, 5, 6, 20)
    assert (speculator.num_speculative_steps, speculator.num_query_per_req) == (7, 8)
    assert speculator.query_cudagraph_manager.query_len == 8


def test_without_a_schedule_nothing_changes():
    speculator = _patched(ranges=None)
    assert getattr(speculator, patch.LAYOUTS) == {}
    speculator.propose(num_speculative_tokens=7)
    assert speculator.seen == [(7, 7, 8, 28)]


def test_managers_dropped_by_vllms_graph_memory_profiling_are_built_again():
    """vLLM's profiling sets every graph manager attribute of the speculator to None; the next
    ``init_cudagraph_manager`` (the real start-up) builds each k's again."""
    speculator = _patched()
    for name, value in list(vars(speculator).items()):
        if isinstance(value, _Manager):
            setattr(speculator, name, None)
    assert getattr(speculator, patch.manager_attr(3)) is None
    speculator.init_cudagraph_manager("FULL")
    speculator.propose(num_speculative_tokens=3)
    assert speculator.seen[-1] == (3, 3, 4, 12)
