"""The vLLM entry point: discoverable, idempotent, cheap to import."""

import importlib.metadata as md
import subprocess
import sys


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
    assert any("causal_conv1d_update" in item for item in first)


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
