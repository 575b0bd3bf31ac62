"""The single vLLM entry point (``vllm.general_plugins: nemotron_spec``).

vLLM calls ``register()`` in every process it starts (API server, engine core, workers), sometimes
more than once per process, so it must be idempotent and cheap: the heavy imports happen inside the
registration functions, and none of them initialises CUDA.
"""

from __future__ import annotations

import importlib
import logging
import threading

logger = logging.getLogger("vllm_nemotron_spec")

# (module, function): each function registers one concern with vLLM, is idempotent on its own, and
# returns a short description of what it registered (for the one log line below).
REGISTRATIONS: tuple[tuple[str, str], ...] = (
    ("vllm_nemotron_spec.nvfp4.config", "register"),  # W4A16 NVFP4 quantization config
    ("vllm_nemotron_spec.nvfp4.compressed_tensors", "register"),  # CT NVFP4A16 drafts on CPU
    ("vllm_nemotron_spec.models", "register"),  # Nemotron 3.5 draft architectures
    ("vllm_nemotron_spec.patches", "apply_all"),  # NemotronH config hook, fixes of vLLM internals
)

_lock = threading.Lock()
_registered: list[str] | None = None


def register() -> list[str]:
    """Register everything this package adds to vLLM; later calls return the first call's result."""
    global _registered
    with _lock:
        if _registered is not None:
            return _registered
        done: list[str] = []
        for module_name, func_name in REGISTRATIONS:
            func = getattr(importlib.import_module(module_name), func_name)
            done.extend(func())
        _registered = done
    from vllm_nemotron_spec import __version__

    _log().info("vllm-nemotron-spec %s registered: %s", __version__, "; ".join(done) or "nothing")
    return done


def _log() -> logging.Logger:
    """vLLM's logger configuration when vLLM is importable (so the line shows in vLLM's log)."""
    try:
        from vllm.logger import init_logger

        return init_logger("vllm.plugins.nemotron_spec")
    except Exception:  # pragma: no cover - vLLM absent (e.g. inspect-only installs)
        return logger
