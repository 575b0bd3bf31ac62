"""Draft model architectures for the Nemotron 3.5 DFlash / DSpark checkpoints.

They are registered under names of their own and reached only through ``target_hook``, which
routes a draft there after the structural check. vLLM's own names are overridden only while that
hook is not installed, by guards that refuse unrouted Nemotron 3.5 drafts (``unrouted.py``). One more
name, ``DFlashQwen3DSparkModel``, exists only to turn a wrong method into a clear error
(``dspark_under_dflash``).
"""

# architecture name -> "module:Class" (lazy: importing a model file imports vLLM's layers).
DRAFT_ARCHITECTURES = {
    "DFlashNemotron35DraftModel": "vllm_nemotron_spec.models.nemotron35_dflash:Nemotron35DFlashForCausalLM",
    "DSparkNemotron35DraftModel": "vllm_nemotron_spec.models.nemotron35_dspark:Nemotron35DSparkForCausalLM",
    # what vLLM renames Qwen3DSparkModel to under method "dflash": lets the clear error through
    "DFlashQwen3DSparkModel": "vllm_nemotron_spec.models.dspark_under_dflash:DSparkDraftUnderDFlash",
}


# vLLM's names for the classes a Nemotron 3.5 draft would load into without the plugin's routing
# -> the guarded stand-ins of ``unrouted.py`` (registered only while the config hook is missing).
UNROUTED_GUARDS = {
    "DFlashDraftModel": "vllm_nemotron_spec.models.unrouted:GuardedDFlashQwen3ForCausalLM",
    "Qwen3DSparkModel": "vllm_nemotron_spec.models.unrouted:GuardedQwen3DSparkForCausalLM",
}


def register_unrouted_guards() -> list[str]:
    """Register the guarded stand-ins under vLLM's own draft names (see ``unrouted.py``)."""
    from vllm import ModelRegistry

    for arch, cls in UNROUTED_GUARDS.items():
        ModelRegistry.register_model(arch, cls)
    return [f"guard {arch} (refuses unrouted Nemotron 3.5 drafts)" for arch in UNROUTED_GUARDS]


def register() -> list[str]:
    """Register the Nemotron 3.5 draft classes with vLLM's ModelRegistry (idempotent)."""
    from vllm import ModelRegistry

    for arch, cls in DRAFT_ARCHITECTURES.items():
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, cls)
    return [f"model {arch}" for arch in DRAFT_ARCHITECTURES]
