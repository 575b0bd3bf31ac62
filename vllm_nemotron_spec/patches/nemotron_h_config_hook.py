"""Patch: vLLM's NemotronH config hook also runs the plugin's ``target_hook.prepare_nemotron_h_config``.

How: ``MODELS_CONFIG_MAP["NemotronHForCausalLM"]`` (vLLM's per-architecture config hook, run once
from ``VllmConfig.__post_init__``) is replaced by a subclass of vLLM's entry whose
``verify_and_update_config`` runs vLLM's own update first, then the plugin's. Every other
architecture keeps vLLM's hook.
"""

from __future__ import annotations

from typing import Any

from vllm_nemotron_spec.patches import install_when_imported

TARGET_MODULE = "vllm.model_executor.models.config"
ARCHITECTURES = ("NemotronHForCausalLM",)


def chain(base: type) -> type:
    """A subclass of vLLM's config hook ``base`` that runs the plugin's decisions after it."""

    class NemotronHSpecConfig(base):  # type: ignore[misc, valid-type]
        """vLLM's NemotronH config hook, then vllm-nemotron-spec's decisions."""

        _nemotron_spec_patch = True
        __wrapped__ = base

        @classmethod
        def verify_and_update_config(cls, vllm_config: Any) -> None:
            from vllm_nemotron_spec.target_hook import prepare_nemotron_h_config

            base.verify_and_update_config(vllm_config)
            prepare_nemotron_h_config(vllm_config)

    return NemotronHSpecConfig


def _install(models_config) -> None:
    for arch in ARCHITECTURES:
        base = models_config.MODELS_CONFIG_MAP.get(arch, models_config.VerifyAndUpdateConfig)
        if not getattr(base, "_nemotron_spec_patch", False):
            models_config.MODELS_CONFIG_MAP[arch] = chain(base)


def install() -> None:
    install_when_imported(__name__.rsplit(".", 1)[-1], TARGET_MODULE, _install)
