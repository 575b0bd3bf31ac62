"""Routing of DFlash drafts: the Nemotron 3.5 layout goes to our class, every other draft keeps
vLLM's, and a draft that does not fit the target stops start-up naming the field."""

import json
import shutil

import pytest

from vllm_nemotron_spec import patches


def _engine_config(target, method, draft, k=4):
    from vllm.engine.arg_utils import EngineArgs

    patches.apply_one("nemotron_h_config_hook")
    from vllm_nemotron_spec import models

    models.register()
    return EngineArgs(
        model=str(target),
        max_model_len=256,
        enable_prefix_caching=False,
        speculative_config={"method": method, "model": str(draft), "num_speculative_tokens": k},
    ).create_engine_config()


def _copy_draft(src, dst, edit):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    edit(config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_nemotron35_dflash_draft_is_routed_to_our_class(tiny_family):
    config = _engine_config(tiny_family.target, "dflash", tiny_family.dflash_draft)
    assert config.speculative_config.draft_model_config.architectures == [
        "DFlashNemotron35DraftModel"
    ]


def test_generic_dflash_draft_keeps_vllms_class(tiny_family, tmp_path):
    def generic(config):  # a z-lab style DFlash config: no own-embedding / aux-id markers
        for key in ("has_embed_tokens", "has_lm_head", "eagle_aux_hidden_state_layer_ids"):
            config.pop(key)

    draft = _copy_draft(tiny_family.dflash_draft, tmp_path / "generic", generic)
    config = _engine_config(tiny_family.target, "dflash", draft)
    assert config.speculative_config.draft_model_config.architectures == ["DFlashDraftModel"]


def test_aux_ids_beyond_the_target_stop_start_up(tiny_family, tmp_path):
    blocks = json.loads((tiny_family.target / "config.json").read_text())["num_hidden_layers"]

    def too_deep(config):
        ids = config["target_layer_ids"][:-1] + [blocks]
        config["target_layer_ids"] = ids
        config["dflash_config"]["target_layer_ids"] = ids
        config["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in ids]

    draft = _copy_draft(tiny_family.dflash_draft, tmp_path / "deep", too_deep)
    with pytest.raises(ValueError) as err:  # vLLM wraps our DraftSpecError in its ValidationError
        _engine_config(tiny_family.target, "dflash", draft)
    message = str(err.value)
    assert f"aux hidden state id {blocks + 1}" in message
    assert f"beyond the target's {blocks} blocks" in message


def test_dflash_draft_under_method_dspark_is_refused_not_rewritten(tiny_family):
    """vLLM 0.32/0.33 silently rewrite an unknown dspark draft architecture to DeepSeek-V4 DSpark;
    the hook reads the checkpoint itself and refuses, naming the right method."""
    with pytest.raises(ValueError) as err:
        _engine_config(tiny_family.target, "dspark", tiny_family.dflash_draft)
    message = str(err.value)
    assert 'speculative_config.method is "dspark"' in message
    assert '{"method": "dflash", ...}' in message
