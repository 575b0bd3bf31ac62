"""Patches of vLLM internals: one module per upstream symbol, each documenting Why / How /
Upstream / Removal in its docstring, each applying only to the vLLM versions and platforms it was
written for. ``apply_all()`` (called by ``plugin.register()`` in every process) is idempotent.

| module                   | upstream symbol                                              | where / versions    |
|--------------------------|--------------------------------------------------------------|---------------------|
| cpu_mamba_conv_state     | mamba_mixer2.causal_conv1d_update                            | CPU, vLLM 0.32.x    |
| cpu_mamba_ssm_state      | ssu_dispatch.CPUSSUBackend.__call__                          | CPU, vLLM 0.32.x    |
| cpu_dflash_context_k_norm| qwen3_dflash.DFlashQwen3Model._normalize_context_k           | CPU, vLLM 0.32.x    |
| cpu_kernel_rebind        | triton_utils.dispatcher._rebind_kernels                      | CPU, vLLM 0.32.x    |
| cpu_expand_kernel        | utils.cpu_triton_utils._expand_kernel_impl                   | CPU, vLLM 0.32.x    |
| cpu_seeded_partial_prefill| CPUModelRunner.sample_tokens (GPUModelRunner._bookkeeping_   | CPU, vLLM 0.32.x    |
|                          | sync's generator set_offset rewind)                          |                     |
| v1_nemotron35_proposers  | VllmConfig._get_v1_model_runner_unsupported_features,        | any, vLLM 0.32/0.33 |
|                          | GPUModelRunner.__init__ / ._input_fits_in_drafter (V1 runner)|                     |
| mamba_spec_decode_padding| sched.scheduler.Scheduler.schedule (spec-decode padding)     | any, vLLM 0.32/0.33 |
"""

from __future__ import annotations

import importlib

PATCH_MODULES = (
    "cpu_mamba_conv_state",
    "cpu_mamba_ssm_state",
    "cpu_dflash_context_k_norm",
    "cpu_kernel_rebind",
    "cpu_expand_kernel",
    "cpu_seeded_partial_prefill",
    "v1_nemotron35_proposers",
    "mamba_spec_decode_padding",
)


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "0")


def apply_all() -> list[str]:
    applied = []
    for name in PATCH_MODULES:
        module = importlib.import_module(f"{__name__}.{name}")
        description = module.apply()
        if description:
            applied.append(f"patch {description}")
    return applied
