"""Tripwire for the method that sets a running engine's k: upstream's scheduler still picks each
step's k from ``self.dynamic_sd_lookup[<batch size>]``, the method sets and restores that lookup
and refuses a k the engine did not capture. A real engine, in vLLM's own engine-core process,
driven through it: tests/e2e/test_batch_size_schedule.py."""

from __future__ import annotations

import ast
import inspect
import textwrap
import types

import pytest

from vllm_nemotron_spec import patches
from vllm_nemotron_spec.patches import engine_core_spec_tokens as patch

STARTED = [0, 4, 2, 0, 1, 1]  # vLLM's dense lookup of [[1, 1, 4], [2, 2, 2], [3, 3, 0], [4, 5, 1]]


def _upstream_schedule():
    from vllm.v1.core.sched.scheduler import Scheduler

    return getattr(Scheduler.schedule, "__wrapped__", Scheduler.schedule)


def test_upstream_schedule_is_the_checked_one_and_reads_the_lookup_by_batch_size():
    method = _upstream_schedule()
    needed, versions = patches.check_target(patch.TARGETS[0], method)
    assert needed and "0.32.0" in versions
    tree = ast.parse(textwrap.dedent(inspect.getsource(method)))
    reads = [
        ast.unparse(node.slice)
        for node in ast.walk(tree)
        if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "self.dynamic_sd_lookup"
    ]
    assert reads == ["len(num_scheduled_tokens)"]


def test_the_built_lookup_is_what_the_method_reads():
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    schedule = [[1, 1, 4], [2, 2, 2], [3, 3, 0], [4, 5, 1]]
    assert build_dynamic_sd_schedule_lookup(schedule, 5, 4) == STARTED


def _core(lookup):
    return types.SimpleNamespace(scheduler=types.SimpleNamespace(dynamic_sd_lookup=lookup))


def test_sets_every_batch_size_then_restores_what_the_engine_started_with():
    from vllm_nemotron_spec import plugin

    plugin.register()
    patches.require("the test", patch.PATCH)
    core = _core(list(STARTED))
    assert patch.set_num_spec_tokens(core, 2) == [0, 1, 2, 4]
    assert core.scheduler.dynamic_sd_lookup == [2] * len(STARTED)
    patch.set_num_spec_tokens(core, 0)
    assert core.scheduler.dynamic_sd_lookup == [0] * len(STARTED)
    patch.set_num_spec_tokens(core, None)
    assert core.scheduler.dynamic_sd_lookup == STARTED


def test_refuses_a_k_without_captured_graphs_and_an_engine_without_a_schedule():
    from vllm_nemotron_spec import plugin

    plugin.register()
    core = _core(list(STARTED))
    with pytest.raises(ValueError, match=r"k=3 is not in the engine's schedule \(k values "
                                         r"\[0, 1, 2, 4\]\)"):  # fmt: skip
        patch.set_num_spec_tokens(core, 3)
    assert core.scheduler.dynamic_sd_lookup == STARTED
    with pytest.raises(ValueError, match="started without num_speculative_tokens_per_batch_size"):
        patch.set_num_spec_tokens(_core(None), 1)


def test_the_engine_core_carries_the_method_after_registration():
    from vllm.v1.engine.core import EngineCore

    from vllm_nemotron_spec import plugin

    plugin.register()
    patches.require("the test", patch.PATCH)
    assert getattr(EngineCore, patch.METHOD) is patch.set_num_spec_tokens


def test_refuses_where_the_patch_is_not_installed(monkeypatch):
    """In an engine-core process where the scheduler's code changed, the method refuses in one
    line naming the patch instead of writing a lookup the scheduler may not read."""
    monkeypatch.setitem(patches._state, patch.PATCH, "not installed: Scheduler.schedule changed")
    core = _core(list(STARTED))
    with pytest.raises(patches.PatchUnavailable, match="needs the vllm-nemotron-spec patch "
                                                       "engine_core_spec_tokens"):  # fmt: skip
        patch.set_num_spec_tokens(core, 2)
    assert core.scheduler.dynamic_sd_lookup == STARTED
