"""A oneDNN GEMM handler garbage-collected while a FakeTensorMode is active (as during a draft's
first compile) releases its handle instead of printing a traceback; tripwire on upstream."""

from __future__ import annotations

import gc
import inspect
import sys

import pytest
import torch

from vllm_nemotron_spec.patches import cpu_onednn_handler_release as patch


def test_handle_of_reads_the_stored_int64():
    value = 94422233754048
    assert patch.handle_of(torch.tensor(value, dtype=torch.int64)) == value


def test_upstream_del_still_reads_the_handle_with_item():
    from vllm import _custom_ops as ops

    patch.install()
    current = ops.CPUDNNLGEMMHandler.__del__
    upstream = getattr(current, "__wrapped__", current)
    assert "self.dtor(self.handler_tensor.item())" in inspect.getsource(upstream)


def test_handler_freed_under_fake_mode_is_released(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from vllm import _custom_ops as ops

    patch.install()
    if not getattr(ops, "_supports_onednn", False):
        pytest.skip("this vLLM build has no oneDNN matmul")
    assert getattr(ops.CPUDNNLGEMMHandler.__del__, "_nemotron_spec_patch", False)
    handler = ops.create_onednn_mm(torch.randn(16, 16).t(), 32)
    handle = int(handler.handler_tensor)
    released = []
    real_dtor = handler.dtor
    handler.dtor = released.append
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    cycle = [handler]
    cycle.append(cycle)  # freed only by the cyclic collector, like vLLM's layers
    del handler, cycle
    with FakeTensorMode():
        gc.collect()
    assert unraisable == []
    assert released == [handle]
    real_dtor(handle)
