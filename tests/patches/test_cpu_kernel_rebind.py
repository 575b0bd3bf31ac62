"""The kernel-rebind patch: survives a foreign object, still rebinds, and pins upstream's source."""

import hashlib
import inspect
import sys
import types

from vllm_nemotron_spec.patches import cpu_kernel_rebind as patch

# sha256 of vLLM 0.32.0's dispatcher._rebind_kernels source, the function the patch replaces.
UPSTREAM_SHA256 = "68f705141997c1e39cf146242eaa0947ed059462017ac96461944d2329b74f64"


class _ForeignDict:
    """Like numba's _lib_fn_wrapper: ``__dict__`` exists but is not a mapping."""

    __dict__ = ("not", "a", "mapping")  # type: ignore[assignment]


def test_foreign_objects_are_skipped_and_kernels_rebound():
    def original():
        pass

    def wrapper():
        pass

    holder = types.SimpleNamespace(kernel=original)
    module = types.ModuleType("_rebind_probe")
    module.copied = original
    module.holder = holder
    module.foreign = _ForeignDict()
    sys.modules[module.__name__] = module
    try:
        patch.rebind_kernels_skipping_foreign_objects([(original, wrapper)])
    finally:
        del sys.modules[module.__name__]
    assert module.copied is wrapper
    assert holder.kernel is wrapper


def test_applied_once_on_cpu():
    from vllm.triton_utils import dispatcher

    patch.install()
    patch.install()
    assert dispatcher._rebind_kernels is patch.rebind_kernels_skipping_foreign_objects


def test_upstream_function_is_the_one_the_patch_was_written_for():
    from vllm.triton_utils import dispatcher

    upstream = getattr(dispatcher._rebind_kernels, "__wrapped__", dispatcher._rebind_kernels)
    digest = hashlib.sha256(inspect.getsource(upstream).encode()).hexdigest()
    assert digest == UPSTREAM_SHA256, (
        "vLLM's triton_utils.dispatcher._rebind_kernels changed: re-check "
        "vllm_nemotron_spec/patches/cpu_kernel_rebind.py (remove it if upstream guards vars())"
    )
