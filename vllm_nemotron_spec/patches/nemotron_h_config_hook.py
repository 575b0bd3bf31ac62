"""Patch: vLLM's NemotronH config hook also runs the plugin's ``target_hook.prepare_nemotron_h_config``.

How: ``MODELS_CONFIG_MAP["NemotronHForCausalLM"]`` (vLLM's per-architecture config hook, run once
from ``VllmConfig.__post_init__``) is replaced by a subclass of vLLM's entry whose
``verify_and_update_config`` runs vLLM's own update first, then the plugin's. Every other
architecture keeps vLLM's hook. The hook only works while vLLM's ``VllmConfig`` still looks the
architecture up in that map and calls its ``verify_and_update_config``: that caller is this
patch's checked target. Installed at registration (both modules are loaded by then, or cheap), so
``plugin.register()`` knows at once whether Nemotron 3.5 drafts must be refused another way.
"""

from __future__ import annotations

import importlib
from typing import Any

from vllm_nemotron_spec.patches import Target, check_when_imported, install_when_imported

NAME = __name__.rsplit(".", 1)[-1]
TARGET_MODULE = "vllm.model_executor.models.config"
CALLER_MODULE = "vllm.config.vllm"
ARCHITECTURES = ("NemotronHForCausalLM",)
TARGETS = (
    Target(
        CALLER_MODULE,
        "VllmConfig.try_verify_and_update_config",
        {"4481be2314d49e6c": "0.32.0, 0.33.0"},
    ),
)


def chain(base: type) -> type:
    """A subclass of vLLM's config hook ``base`` that runs the plugin's decisions after it."""

    class NemotronHSpecConfig(base):  # type: ignore[misc, valid-type]
        """vLLM's NemotronH config hook, then vllm-nemotron-spec's decisions."""

        _nemotron_spec_patch = True
        __wrapped__ = base

        @classmethod
        def verify_and_update_config(cls, vllm_config: Any) -> None:
            from vllm_nemotron_spec.patches import is_installed
            from vllm_nemotron_spec.target_hook import prepare_nemotron_h_config

            base.verify_and_update_config(vllm_config)
            if is_installed(NAME):  # a part found changed later: vLLM's hook only
                prepare_nemotron_h_config(vllm_config)

    return NemotronHSpecConfig


def _install(models_config) -> None:
    for arch in ARCHITECTURES:
        base = models_config.MODELS_CONFIG_MAP.get(arch, models_config.VerifyAndUpdateConfig)
        if not getattr(base, "_nemotron_spec_patch", False):
            models_config.MODELS_CONFIG_MAP[arch] = chain(base)


def install() -> None:
    check_when_imported(NAME, CALLER_MODULE, "VllmConfig.try_verify_and_update_config")
    install_when_imported(NAME, TARGET_MODULE, _install)
    for module in (CALLER_MODULE, TARGET_MODULE):  # decide now, not at the first config
        importlib.import_module(module)
