"""The vLLM entry point: discoverable, idempotent, cheap to import."""

import importlib.metadata as md
import subprocess
import sys

import pytest


def test_entry_point_is_installed():
    eps = md.entry_points(group="vllm.general_plugins")
    ours = [ep for ep in eps if ep.name == "nemotron_spec"]
    assert ours, "pip install -e . registers the vllm.general_plugins entry point"
    assert ours[0].value == "vllm_nemotron_spec.plugin:register"


def test_register_is_idempotent_and_reports_what_it_did():
    from vllm_nemotron_spec import plugin

    first = plugin.register()
    second = plugin.register()
    assert first is second
    assert any(item.startswith("patch cpu_mamba_conv_state: ") for item in first)
    assert any(item.startswith("model DFlashNemotron35DraftModel") for item in first)


def test_a_failing_concern_is_recorded_logged_and_never_raised(monkeypatch, caplog):
    """vLLM calls register() without a try/except: a failure there would stop every model."""
    import logging

    from vllm_nemotron_spec import plugin

    def broken():
        raise ImportError("cannot import name 'X' from 'vllm.somewhere'")

    import vllm_nemotron_spec.nvfp4.config as quant

    monkeypatch.setattr(quant, "register", broken)
    monkeypatch.setattr(plugin, "_registered", None)
    monkeypatch.setattr(plugin, "_failed", {})
    with caplog.at_level(logging.ERROR):
        done = plugin.register()
    assert plugin.failed() == {
        "quantization": "ImportError: cannot import name 'X' from 'vllm.somewhere'"
    }
    assert quant._DESCRIPTION not in done
    assert any(item.startswith("model ") for item in done)  # the other concerns registered
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "quantization not registered" in errors[0]
    with pytest.raises(
        plugin.RegistrationFailed, match="needs the vllm-nemotron-spec registration of quantization"
    ):
        plugin.require_registered("the Nemotron 3.5 dflash draft", "models", "quantization")
    plugin.require_registered("the Nemotron 3.5 dflash draft", "models")  # registered: no error


def test_the_startup_line_names_the_vllm_version_and_every_patch_state():
    from vllm_nemotron_spec import patches, plugin

    line = plugin.startup_line(plugin.register())
    assert line.startswith("vllm-nemotron-spec 0.1.0 on vLLM 0.32.0 (cpu): registered ")
    assert "\n" not in line
    for patch in patches.PATCHES:
        if patch.on_register:
            assert f"{patch.name} {patches.state(patch.name)}" in line


def test_importing_the_plugin_module_imports_neither_torch_nor_vllm():
    code = (
        "import sys, vllm_nemotron_spec.plugin, vllm_nemotron_spec.cli.main;"
        "print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_vllm_loads_our_plugin_through_its_own_loader():
    code = (
        "from vllm.plugins import load_general_plugins; load_general_plugins();"
        "from vllm_nemotron_spec import plugin; print(plugin._registered is not None)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "True"
