"""The ``vllm`` passthrough: vLLM's CLI with one-line config errors."""


def test_help_lists_every_subcommand(capsys):
    from vllm_nemotron_spec.cli.main import build_parser

    text = build_parser().format_help()
    for command in ("make-tiny", "demo", "inspect", "bench", "tune", "vllm"):
        assert command in text
