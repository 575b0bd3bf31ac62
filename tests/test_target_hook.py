"""The NemotronH config hook: chained onto vLLM's, NemotronH only, prefix caching off on CPU."""

import json

from vllm_nemotron_spec import target_hook


def test_register_chains_vllm_nemotron_h_hook_only():
    from vllm.model_executor.models import config as models_config

    before = dict(models_config.MODELS_CONFIG_MAP)
    first = target_hook.register()
    hook = models_config.MODELS_CONFIG_MAP["NemotronHForCausalLM"]
    assert target_hook.register() == first  # idempotent: no second wrapper
    assert models_config.MODELS_CONFIG_MAP["NemotronHForCausalLM"] is hook
    assert issubclass(hook, models_config.NemotronHForCausalLMConfig)  # vLLM's own hook kept
    after = models_config.MODELS_CONFIG_MAP
    changed = {arch for arch, cls in after.items() if cls is not before.get(arch)}
    assert changed <= {"NemotronHForCausalLM"}
    assert "LlamaForCausalLM" not in after


def _engine_config(model_dir, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    target_hook.register()
    return EngineArgs(model=str(model_dir), skip_tokenizer_init=True, max_model_len=256,
                      **kwargs).create_engine_config()


def test_prefix_caching_is_turned_off_for_nemotron_h_on_cpu(tiny_family):
    config = _engine_config(tiny_family.target)
    assert config.cache_config.enable_prefix_caching is False


def test_prefix_caching_of_other_models_is_left_alone(tmp_path):
    llama = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512,
                 hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512)
    (tmp_path / "config.json").write_text(json.dumps(llama))
    config = _engine_config(tmp_path, enable_prefix_caching=True)
    assert config.cache_config.enable_prefix_caching is True
