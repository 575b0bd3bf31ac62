"""Patches of vLLM internals: one module per upstream symbol, each documenting Why / How /
Upstream / Removal in its docstring, each applying only to the vLLM versions and platforms it was
written for. ``apply_all()`` (called by ``plugin.register()`` in every process) is idempotent;
each patch is installed when its upstream module is imported (``when_imported``), so a process
that never imports the V1 runner or the scheduler does not import them for the plugin.

| module                   | upstream symbol                                              | where / versions    |
|--------------------------|--------------------------------------------------------------|---------------------|
| cpu_mamba_conv_state     | mamba_mixer2.causal_conv1d_update                            | CPU, vLLM 0.32.x    |
| cpu_mamba_ssm_state      | ssu_dispatch.CPUSSUBackend.__call__                          | CPU, vLLM 0.32.x    |
| cpu_mamba_align_cache    | ssd_combined._mamba_chunk_scan_combined_fwd, mamba_mixer2.   | CPU, vLLM 0.32.x    |
|                          | store_prefill_checkpoint, mamba_utils.precopy_mamba_align_   |                     |
|                          | fused_kernel / .postprocess_mamba_fused_kernel               |                     |
| cpu_dflash_context_k_norm| qwen3_dflash.DFlashQwen3Model._normalize_context_k           | CPU, vLLM 0.32.x    |
| cpu_kernel_rebind        | triton_utils.dispatcher._rebind_kernels                      | CPU, vLLM 0.32.x    |
| cpu_expand_kernel        | utils.cpu_triton_utils._expand_kernel_impl                   | CPU, vLLM 0.32.x    |
| cpu_seeded_partial_prefill| CPUModelRunner.sample_tokens (GPUModelRunner._bookkeeping_   | CPU, vLLM 0.32.x    |
|                          | sync's generator set_offset rewind)                          |                     |
| v1_nemotron35_proposers  | VllmConfig._get_v1_model_runner_unsupported_features,        | any, vLLM 0.32/0.33 |
|                          | GPUModelRunner.__init__ / ._input_fits_in_drafter (V1 runner)|                     |
| mamba_spec_decode_padding| sched.scheduler.Scheduler.schedule (spec-decode padding)     | any, vLLM 0.32/0.33 |
| nemotron35_prefix_cache_ | SpeculativeConfig.use_eagle_block_drop (no trailing-block    | any, vLLM 0.32.x    |
| block                    | drop for routed Nemotron 3.5 DFlash/DSpark drafts)           |                     |
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
from types import ModuleType
from typing import Callable

PATCH_MODULES = (
    "cpu_mamba_conv_state",
    "cpu_mamba_ssm_state",
    "cpu_mamba_align_cache",
    "cpu_dflash_context_k_norm",
    "cpu_kernel_rebind",
    "cpu_expand_kernel",
    "cpu_seeded_partial_prefill",
    "v1_nemotron35_proposers",
    "mamba_spec_decode_padding",
    "nemotron35_prefix_cache_block",
)


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "0")


def applies(versions: tuple[str, ...], *, cpu_only: bool) -> bool:
    """Whether a patch written for ``versions`` (prefixes such as "0.32.") applies here."""
    if not vllm_version().startswith(versions):
        return False
    if cpu_only:
        from vllm.platforms import current_platform

        return current_platform.is_cpu()
    return True


def replace_when_imported(module_name: str, owner: str | None, attr: str,
                          make: Callable[[Callable], Callable | None]) -> None:
    """Once ``module_name`` is imported, replace ``owner.attr`` (``owner``: a class of the module,
    or None for the module itself) by ``make(current)``, unless it is already the plugin's (the
    replacement is marked ``_nemotron_spec_patch`` and keeps the upstream object in
    ``__wrapped__``: ``make`` need not do either). ``make`` returning None declines: upstream's
    object stays, unmarked. Idempotent."""

    def install(module):
        target = module if owner is None else getattr(module, owner)
        current = getattr(target, attr)
        if getattr(current, "_nemotron_spec_patch", False):
            return
        replacement = make(current)
        if replacement is None:
            return
        replacement.__wrapped__ = current
        replacement._nemotron_spec_patch = True
        setattr(target, attr, replacement)

    when_imported(module_name, install)


def when_imported(module_name: str, install: Callable[[ModuleType], None]) -> None:
    """Run ``install(module)`` on ``module_name``: now if it is imported, else right after its
    first import (before the importer sees it).

    Why: ``plugin.register()`` runs in every vLLM process (API server, engine core, workers), and
    the modules patched here (the V1 runner, the scheduler, model layers) cost seconds and ~1000
    modules to import; a process that never imports them does not pay for their patches."""
    module = sys.modules.get(module_name)
    if module is not None:
        install(module)
        return
    finder = next((f for f in sys.meta_path if isinstance(f, _PostImportFinder)), None)
    if finder is None:
        finder = _PostImportFinder()
        sys.meta_path.insert(0, finder)
    finder.hooks.setdefault(module_name, []).append(install)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a module with pending hooks it asks the other finders and wraps
    the loader so that the hooks run once the module has executed."""

    def __init__(self):
        self.hooks: dict[str, list[Callable[[ModuleType], None]]] = {}

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.hooks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _InstallingLoader(spec.loader, self.hooks.pop(fullname))
        return spec


class _InstallingLoader(importlib.abc.Loader):
    def __init__(self, loader, hooks):
        self._loader, self._hooks = loader, hooks

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = module.__spec__.loader = self._loader  # get_source etc. as before
        self._loader.exec_module(module)
        for install in self._hooks:
            install(module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


def apply_all() -> list[str]:
    applied = []
    for name in PATCH_MODULES:
        module = importlib.import_module(f"{__name__}.{name}")
        description = module.apply()
        if description:
            applied.append(f"patch {description}")
    return applied
