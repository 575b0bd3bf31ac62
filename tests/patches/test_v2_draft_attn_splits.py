"""Tripwire for the draft's FlashAttention split cap: upstream's ``attn_vllm_config`` is the
checked one, and the patched property gives a Nemotron 3.5 draft's attention builders the cap
from ``NEMOTRON_SPEC_DRAFT_ATTN_SPLITS`` while the target's config and every other draft keep
vLLM's."""

from __future__ import annotations

import inspect
import types

import pytest

from vllm_nemotron_spec import patches
from vllm_nemotron_spec.patches import v2_draft_attn_splits as patch


def _speculator_class():
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    return DFlashSpeculator


def _upstream_fget():
    prop = _speculator_class().__dict__[patch.PROPERTY]
    return getattr(prop.fget, "__wrapped__", prop.fget)


def test_upstream_property_is_the_checked_one_and_copies_the_attention_config():
    fget = _upstream_fget()
    needed, versions = patches.check_target(patch.TARGETS[0], fget)
    assert needed and "0.32.0" in versions
    source = inspect.getsource(fget)
    assert "copy.copy(" in source and "replace(" in source and "use_non_causal" in source


def test_a_changed_property_is_a_changed_target():
    class DFlashSpeculator:
        @property
        def attn_vllm_config(self):
            return self.vllm_config

    with pytest.raises(patches.ShapeMismatch, match="attn_vllm_config.fget changed"):
        patches.check_target(patch.TARGETS[0], DFlashSpeculator.attn_vllm_config.fget)


def _speculator(draft_spec, non_causal=False):
    """A DFlashSpeculator with only what the property reads: the engine's config, the draft's
    causality and its model."""
    from vllm.config import AttentionConfig

    speculator = object.__new__(_speculator_class())
    speculator.vllm_config = types.SimpleNamespace(attention_config=AttentionConfig())
    speculator.requires_non_causal = non_causal
    speculator.model = types.SimpleNamespace(draft_spec=draft_spec)
    return speculator


@pytest.fixture
def installed():
    from vllm_nemotron_spec import plugin

    plugin.register()
    patches.require("the test", patch.NAME)
    assert getattr(_speculator_class().__dict__[patch.PROPERTY].fget, "_nemotron_spec_patch")


def test_a_nemotron_draft_gets_the_cap_and_the_target_keeps_vllms(installed, monkeypatch):
    monkeypatch.setenv(patch.ENV, "1")
    speculator = _speculator(draft_spec=object(), non_causal=True)
    target_default = getattr(speculator.vllm_config.attention_config, patch.FIELD)
    assert target_default > 1  # vLLM's cap, which the draft's must differ from
    config = speculator.attn_vllm_config
    assert getattr(config.attention_config, patch.FIELD) == 1
    assert config.attention_config.use_non_causal is True  # upstream's change kept
    assert getattr(speculator.vllm_config.attention_config, patch.FIELD) == target_default
    assert speculator.vllm_config.attention_config.use_non_causal is False


def test_other_drafts_and_an_unset_variable_keep_vllms_cap(installed, monkeypatch):
    monkeypatch.setenv(patch.ENV, "2")
    default = getattr(_speculator(None).vllm_config.attention_config, patch.FIELD)
    assert getattr(_speculator(None).attn_vllm_config.attention_config, patch.FIELD) == default
    monkeypatch.delenv(patch.ENV)
    nemotron = _speculator(draft_spec=object())
    assert getattr(nemotron.attn_vllm_config.attention_config, patch.FIELD) == default


@pytest.mark.parametrize("text", ["0", "-3", "two", "1.5"])
def test_a_bad_value_names_the_variable(installed, monkeypatch, text):
    monkeypatch.setenv(patch.ENV, text)
    with pytest.raises(ValueError, match=f"{patch.ENV}={text!r}: expected a positive integer"):
        _speculator(draft_spec=object()).attn_vllm_config


def test_the_cap_is_read_as_written():
    assert patch.draft_splits({}) is None
    assert patch.draft_splits({patch.ENV: " "}) is None
    assert patch.draft_splits({patch.ENV: "4"}) == 4
