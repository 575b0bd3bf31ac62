"""The trailing-block patch: routed Nemotron 3.5 DFlash/DSpark drafts keep the prefix cache's last
block, every other speculative method keeps vLLM's answer; a tripwire for vLLM 0.32's rule.
(Equal hit counts and exact outputs through a real server: tests/e2e/test_recipe_serving.py.)"""

from types import SimpleNamespace

import pytest

from vllm_nemotron_spec.patches import nemotron35_prefix_cache_block as patch


def _engine_config(target, spec):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_nemotron_spec import patches

    patches.apply_one("nemotron_h_config_hook")
    return EngineArgs(
        model=str(target),
        skip_tokenizer_init=True,
        max_model_len=256,
        enable_prefix_caching=True,
        speculative_config=spec,
    ).create_engine_config()


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_routed_drafts_keep_the_trailing_block_and_vllm_alone_drops_it(tiny_family, method):
    from vllm_nemotron_spec.tiny.train_draft import ensure_trained_drafts

    patch.install()
    draft = getattr(ensure_trained_drafts(family=tiny_family), method)
    config = _engine_config(
        tiny_family.target, {"method": method, "model": str(draft), "num_speculative_tokens": 3}
    )
    spec = config.speculative_config
    assert config.cache_config.mamba_cache_mode == "align"
    assert patch.routed_architecture(spec)
    assert spec.use_eagle_block_drop() is False
    # Tripwire: vLLM 0.32 on its own drops it for DFlash/DSpark (0.33 does not).
    assert type(spec).use_eagle_block_drop.__wrapped__(spec) is True, (
        "vLLM no longer drops the trailing block for DFlash/DSpark: remove "
        "vllm_nemotron_spec/patches/nemotron35_prefix_cache_block.py"
    )


@pytest.mark.parametrize(
    "method, archs",
    [
        ("eagle", ["DFlashNemotron35DraftModel"]),  # not DFlash/DSpark
        ("dflash", ["DFlashQwen3Model"]),  # vLLM's own class: not routed by the plugin
        ("dspark", ["DFlashNemotron35DraftModel", "X"]),
    ],
)
def test_other_drafts_keep_vllms_answer(method, archs):
    spec = SimpleNamespace(
        method=method,
        draft_model_config=SimpleNamespace(hf_config=SimpleNamespace(architectures=archs)),
    )
    assert patch.routed_architecture(spec) is None
    assert patch._wrap(lambda self: True)(spec) is True
    assert patch._wrap(lambda self: False)(spec) is False


def test_applied_once():
    from vllm.config.speculative import SpeculativeConfig

    patch.install()
    first = SpeculativeConfig.use_eagle_block_drop
    patch.install()
    assert SpeculativeConfig.use_eagle_block_drop is first and first._nemotron_spec_patch
