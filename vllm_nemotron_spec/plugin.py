"""The single vLLM entry point (``vllm.general_plugins: nemotron_spec``).

vLLM calls ``register()`` in every process it starts (API server, engine core, workers), sometimes
more than once per process, and without a try/except: so it is idempotent, cheap (the heavy
imports happen inside the registration functions, none initialises CUDA), and never raises. Each
concern registers on its own; one that fails is logged once as an error and only the Nemotron 3.5
features that need it refuse (``require_registered``), while vLLM serves every other model as if
the plugin were not installed. One INFO line says what was registered and each patch's state.
"""

from __future__ import annotations

import importlib
import logging
import threading
from dataclasses import dataclass

logger = logging.getLogger("vllm_nemotron_spec")


@dataclass(frozen=True)
class Registration:
    """One concern: ``module.function()`` registers it with vLLM (idempotent) and returns short
    descriptions of what it registered."""

    concern: str
    module: str
    function: str


REGISTRATIONS: tuple[Registration, ...] = (
    Registration("quantization", "vllm_nemotron_spec.nvfp4.config", "register"),
    Registration("compressed-tensors", "vllm_nemotron_spec.nvfp4.compressed_tensors", "register"),
    Registration("models", "vllm_nemotron_spec.models", "register"),
    Registration("patches", "vllm_nemotron_spec.patches", "apply_all"),
)

_lock = threading.Lock()
_registered: list[str] | None = None
_failed: dict[str, str] = {}  # concern -> why it did not register
_announced = False


class RegistrationFailed(ValueError):
    """A feature needs a concern whose registration failed (a ValueError: vLLM reports it as a
    config error at start-up)."""


def register() -> list[str]:
    """Register everything this package adds to vLLM; later calls return the first call's result.
    Never raises."""
    global _registered
    with _lock:
        if _registered is not None:
            return _registered
        done: list[str] = []
        for registration in REGISTRATIONS:
            done.extend(_register_one(registration))
        done.extend(_guard_unrouted_drafts())
        _registered = done
    if _vllm_logging_configured():
        announce()
    return done


def announce() -> None:
    """Log the start-up line once per process. vLLM configures its logging after it loads
    plugins in the offline ``LLM`` path, so the NemotronH config hook calls this again (the
    patch states are the more complete then)."""
    global _announced
    if _announced or _registered is None:
        return
    _announced = True
    try:
        _log().info(startup_line(_registered))
    except Exception:  # pragma: no cover - logging must not break vLLM either
        pass


def _vllm_logging_configured() -> bool:
    return bool(logging.getLogger("vllm").handlers)


def _register_one(registration: Registration) -> list[str]:
    try:
        func = getattr(importlib.import_module(registration.module), registration.function)
        return list(func())
    except Exception as e:  # never into vLLM: it would break every model, not only ours
        _failed[registration.concern] = _one_line(e)
        _log().error(
            "vllm-nemotron-spec: %s not registered (%s); Nemotron 3.5 drafts that need it are "
            "refused at start-up, every other model is unaffected",
            registration.concern,
            _failed[registration.concern],
        )
        return []


def _guard_unrouted_drafts() -> list[str]:
    """Without the NemotronH config hook no Nemotron 3.5 draft is checked or routed: register
    stand-ins for vLLM's draft classes that refuse such a draft (``models/unrouted.py``)."""
    try:
        from vllm_nemotron_spec import patches

        hook = "nemotron_h_config_hook"
        if "patches" not in _failed and patches.is_installed(hook):
            return []
        from vllm_nemotron_spec.models import register_unrouted_guards

        guards = register_unrouted_guards()
        why = _failed.get("patches") or patches.state(hook)
        _log().warning(
            "vllm-nemotron-spec: the NemotronH config hook is %s: Nemotron 3.5 drafts are refused "
            "(%s); every other model is unaffected",
            why,
            ", ".join(guards),
        )
        return guards
    except Exception as e:
        _failed["unrouted-guards"] = _one_line(e)
        _log().error(
            "vllm-nemotron-spec: neither the NemotronH config hook nor the guard of vLLM's "
            "draft classes is registered (%s): uninstall the plugin or set VLLM_PLUGINS to "
            "exclude nemotron_spec",
            _failed["unrouted-guards"],
        )
        return []


def failed() -> dict[str, str]:
    """Concerns whose registration failed in this process, with why."""
    return dict(_failed)


def require_registered(feature: str, *concerns: str) -> None:
    """Raise ``RegistrationFailed`` (one line) if any of ``concerns`` did not register."""
    for concern in concerns:
        if concern in _failed:
            raise RegistrationFailed(
                f"{feature} needs the vllm-nemotron-spec registration of {concern}, which "
                f"failed in this process ({_failed[concern]})"
            )


def startup_line(done: list[str]) -> str:
    """'vllm-nemotron-spec X on vLLM Y: ...' with what registered, what failed, each patch."""
    from vllm_nemotron_spec import __version__, patches

    version, platform = _vllm_and_platform()
    note = patches.supported_range_note(version, platform == "cpu")
    parts = [f"vllm-nemotron-spec {__version__} on vLLM {version} ({platform}"]
    parts[0] += f"; {note})" if note else ")"
    registered = [d for d in done if not d.startswith("patch ")]
    line = parts[0] + ": registered " + (", ".join(registered) or "nothing")
    if _failed:
        line += "; FAILED " + ", ".join(f"{k} ({v})" for k, v in _failed.items())
    states = [f"{p.name} {patches.state(p.name)}" for p in patches.PATCHES if p.on_register]
    return line + "; patches: " + "; ".join(states)


def _vllm_and_platform() -> tuple[str, str]:
    try:
        from vllm.platforms import current_platform

        from vllm_nemotron_spec.patches import vllm_version

        return vllm_version(), "cpu" if current_platform.is_cpu() else "gpu"
    except Exception:
        return "unknown", "unknown"


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _log() -> logging.Logger:
    """vLLM's logger configuration when vLLM is importable (so the line shows in vLLM's log)."""
    try:
        from vllm.logger import init_logger

        return init_logger("vllm.plugins.nemotron_spec")
    except Exception:  # pragma: no cover - vLLM absent (e.g. inspect-only installs)
        return logger
