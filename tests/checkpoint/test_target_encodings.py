"""Every encoding of a NemotronH target's blocks, as transformers itself writes and loads them.

transformers >= 5 ``NemotronHConfig.save_pretrained`` writes ``layers_block_type`` (a list) and
neither ``hybrid_override_pattern`` nor ``num_hidden_layers``; older checkpoints (the published
ones) carry the pattern string; multimodal wrappers nest the text model under ``text_config``;
vLLM hands the plugin the loaded config object, whose properties derive the pattern. Each gives
the tiny target's 14 blocks, and ``inspect`` accepts the trained drafts against each.
"""

from __future__ import annotations

import json

import pytest

from vllm_nemotron_spec.checkpoint.inspect import inspect_checkpoint
from vllm_nemotron_spec.checkpoint.spec import DraftSpecError, target_num_blocks

BLOCKS = 14


@pytest.fixture(scope="module")
def saved(tiny_family, tmp_path_factory):
    """The tiny target's config, loaded and saved again by the installed transformers."""
    from transformers import NemotronHConfig

    out = tmp_path_factory.mktemp("t5-target")
    config = NemotronHConfig.from_pretrained(str(tiny_family.target))
    config.save_pretrained(str(out))
    return config, out


def _write(tmp_path, name, cfg):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_save_pretrained_writes_only_layers_block_type(saved):
    _, out = saved
    cfg = json.loads((out / "config.json").read_text())
    assert isinstance(cfg["layers_block_type"], list) and len(cfg["layers_block_type"]) == BLOCKS
    assert cfg.get("hybrid_override_pattern") is None and cfg.get("num_hidden_layers") is None


def test_every_encoding_counts_the_same_blocks(saved, tmp_path, tiny_family):
    from transformers import AutoConfig

    config, out = saved
    t5 = json.loads((out / "config.json").read_text())
    pattern_only = {k: v for k, v in t5.items() if k != "layers_block_type"}
    pattern_only["hybrid_override_pattern"] = config.hybrid_override_pattern  # transformers' own
    nested = {"architectures": ["NemotronHForCausalLM"], "text_config": t5}
    legacy_names = dict(
        t5,
        layers_block_type=[
            {"linear_attention": "mamba", "full_attention": "attention"}.get(t, t)
            for t in t5["layers_block_type"]
        ],
    )
    for cfg in (t5, pattern_only, nested, legacy_names):
        assert target_num_blocks(cfg) == BLOCKS
    assert target_num_blocks(config) == BLOCKS  # the object vLLM passes
    assert target_num_blocks(AutoConfig.from_pretrained(str(out))) == BLOCKS
    assert (
        pattern_only["hybrid_override_pattern"]
        == json.loads((tiny_family.target / "config.json").read_text())["hybrid_override_pattern"]
    )


def test_inspect_accepts_the_trained_drafts_against_each_encoding(saved, tmp_path, tiny_family):
    from vllm_nemotron_spec.tiny.train_draft import ensure_trained_drafts

    _, out = saved
    t5 = json.loads((out / "config.json").read_text())
    nested = _write(
        tmp_path, "nested", {"architectures": ["NemotronHForCausalLM"], "text_config": t5}
    )
    trained = ensure_trained_drafts(family=tiny_family)
    for draft in (trained.dspark, trained.dflash):
        for target in (out, nested, tiny_family.target):
            report = inspect_checkpoint(str(draft), target=str(target))
            assert report["problems"] == [] and report["target_blocks"] == BLOCKS, target


def test_a_target_without_blocks_is_still_refused(saved):
    _, out = saved
    t5 = json.loads((out / "config.json").read_text())
    with pytest.raises(DraftSpecError, match="missing `layers_block_type`"):
        target_num_blocks({k: v for k, v in t5.items() if k != "layers_block_type"})
    with pytest.raises(DraftSpecError, match="`target.layers_block_type`: expected a non-empty"):
        target_num_blocks(dict(t5, layers_block_type=["mamba", "conv"]))
