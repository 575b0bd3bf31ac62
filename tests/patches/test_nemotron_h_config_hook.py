"""The NemotronH config hook is chained onto vLLM's, for NemotronH only, once."""

from vllm_nemotron_spec import patches


def test_register_chains_vllm_nemotron_h_hook_only():
    from vllm.model_executor.models import config as models_config

    before = dict(models_config.MODELS_CONFIG_MAP)
    assert patches.apply_one("nemotron_h_config_hook")
    hook = models_config.MODELS_CONFIG_MAP["NemotronHForCausalLM"]
    assert patches.apply_one("nemotron_h_config_hook")  # idempotent: no second wrapper
    assert patches.is_installed("nemotron_h_config_hook")
    assert models_config.MODELS_CONFIG_MAP["NemotronHForCausalLM"] is hook
    assert issubclass(hook, models_config.NemotronHForCausalLMConfig)  # vLLM's own hook kept
    after = models_config.MODELS_CONFIG_MAP
    changed = {arch for arch, cls in after.items() if cls is not before.get(arch)}
    assert changed <= {"NemotronHForCausalLM"}
    assert "LlamaForCausalLM" not in after
