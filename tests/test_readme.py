"""The README's commands work as written: every ``vllm-nemotron-spec`` command line parses; the
``vllm serve`` lines parse with vLLM's own parser, name parsers vLLM has, and their speculative
configs build a vLLM config with the tiny family in place of the Nemotron 3.5 checkpoints; the
``vllm bench serve`` lines parse and are greedy; the python blocks run as scripts on this machine;
``scripts/install.sh`` flags, package extras and relative links exist."""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

TARGET_ID = "nvidia/NVIDIA-Nemotron-3.5-Lightning-30B-A3B-NVFP4"


def blocks(language: str) -> list[str]:
    text = README.read_text("utf-8")
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)


def command_lines(block: str) -> list[list[str]]:
    """Shell command lines of a block: continuation lines joined, ``&&`` split, comments and
    environment assignments dropped, as argument lists."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        for part in line.split("&&"):
            argv = shlex.split(part, comments=True)
            while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):
                argv.pop(0)
            if argv:
                out.append(argv)
    return out


def readme_commands(program: str) -> list[list[str]]:
    found = []
    for block in blocks("bash"):
        for argv in command_lines(block):
            if Path(argv[0]).name == program:
                found.append(argv[1:])
    return found


def test_readme_has_the_commands_this_test_checks():
    assert len(blocks("python")) >= 1
    commands = readme_commands("vllm-nemotron-spec")
    assert {argv[0] for argv in commands} >= {"demo", "inspect", "bench", "quantize", "vllm"}
    assert any("--speculative-config" in argv for argv in serve_commands())


@pytest.mark.parametrize("argv", readme_commands("vllm-nemotron-spec"), ids=" ".join)
def test_readme_cli_command_parses(argv):
    from vllm_nemotron_spec.cli.main import build_parser

    args, extra = build_parser().parse_known_args(argv)
    assert args.command == argv[0]
    assert not extra or getattr(args, "accepts_extra_args", False), extra


def vllm_cli_commands() -> list[list[str]]:
    """Arguments of ``vllm ...`` lines, plain or through the passthrough."""
    return readme_commands("vllm") + [
        a[1:] for a in readme_commands("vllm-nemotron-spec") if a[0] == "vllm"
    ]


def serve_commands() -> list[list[str]]:
    """``vllm serve`` lines: the arguments after ``serve``."""
    return [argv[1:] for argv in vllm_cli_commands() if argv[:1] == ["serve"]]


def parse_serve_args(argv: list[str]):
    """``argv`` parsed and validated as ``vllm serve`` does."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    try:
        from vllm.entrypoints.launchers import cli_args  # vLLM 0.32
    except ImportError:  # pragma: no cover - vLLM 0.33
        from vllm.entrypoints.common import cli_args
    args = cli_args.make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    cli_args.validate_parsed_serve_args(args)
    return args


@pytest.mark.parametrize("argv", serve_commands(), ids=" ".join)
def test_readme_serve_line_parses(argv):
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    args = parse_serve_args(argv)
    assert args.model_tag == TARGET_ID, argv
    if args.reasoning_parser:
        ReasoningParserManager.get_reasoning_parser(args.reasoning_parser)
    if args.tool_call_parser:
        ToolParserManager.get_tool_parser(args.tool_call_parser)


def with_tiny_family(text: str, tiny_family, trained_drafts) -> str:
    """``text`` with the tiny family's paths in place of the Nemotron 3.5 Hub ids."""
    for hub_id, path in (
        (f"{TARGET_ID}-DFlash", trained_drafts.dflash),
        (f"{TARGET_ID}-DSpark", trained_drafts.dspark),
        (TARGET_ID, tiny_family.target),
    ):
        text = text.replace(hub_id, str(path))
    return text


def speculative_configs() -> list[str]:
    configs = []
    for argv in serve_commands():
        config = json.dumps(parse_serve_args(argv).speculative_config, sort_keys=True)
        if config != "null" and config not in configs:
            configs.append(config)
    return configs


@pytest.mark.parametrize("config", speculative_configs())
def test_readme_speculative_config_builds_a_vllm_config(config, tiny_family, trained_drafts):
    """vLLM accepts the line's speculative config (drafted tokens given where vLLM needs them,
    the method matching the draft, within its trained block), with the tiny family's drafts in
    place of the official ones; the plugin's config hook checks the draft on the way."""
    from vllm.engine.arg_utils import EngineArgs

    speculative_config = json.loads(with_tiny_family(config, tiny_family, trained_drafts))
    assert "nvidia/" not in json.dumps(speculative_config)
    vllm_config = EngineArgs(
        model=str(tiny_family.target),
        dtype="float32",
        max_model_len=512,
        enable_prefix_caching=False,
        speculative_config=speculative_config,
    ).create_engine_config()
    assert vllm_config.speculative_config.method == speculative_config["method"]


def test_readme_install_flags_exist():
    script = (ROOT / "scripts" / "install.sh").read_text("utf-8")
    accepted = set(re.findall(r"^\s*(--[a-z-]+)\)", script, flags=re.MULTILINE))
    used = re.findall(r"bash scripts/install\.sh((?: --[a-z-]+)*)", README.read_text("utf-8"))
    assert used and accepted
    for flags in used:
        assert set(flags.split()) <= accepted, (flags, accepted)


def test_readme_extras_exist():
    """Every ``.[extra]`` / ``whl[extra]`` the README installs is one of setup.py's extras."""
    tree = ast.parse((ROOT / "setup.py").read_text("utf-8"))
    (extras,) = [
        list(ast.literal_eval(k.value))
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        for k in node.keywords
        if k.arg == "extras_require"
    ]
    used = re.findall(r"(?:\.|\.whl)\[([a-z,]+)\]", README.read_text("utf-8"))
    assert used
    for names in used:
        assert set(names.split(",")) <= set(extras), (names, sorted(extras))


def test_readme_relative_links_resolve():
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", README.read_text("utf-8"))
    assert links
    for link in links:
        assert (ROOT / link).exists(), link


def bench_serve_commands() -> list[list[str]]:
    """``vllm bench serve`` lines, plain or through the passthrough."""
    return [argv[2:] for argv in vllm_cli_commands() if argv[:2] == ["bench", "serve"]]


def test_readme_bench_serve_lines_parse_and_are_greedy():
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    full = [argv for argv in bench_serve_commands() if "--model" in argv]
    assert full, "no complete `vllm bench serve` line in the README"
    for argv in full:
        parser = FlexibleArgumentParser()
        add_cli_args(parser)
        args = parser.parse_args(argv)
        assert args.temperature == 0.0, argv
        assert args.host == "127.0.0.1" and args.port == 8000


@pytest.fixture(scope="module")
def trained_drafts(tiny_family):
    from vllm_nemotron_spec.tiny.train_draft import ensure_trained_drafts

    return ensure_trained_drafts(family=tiny_family)


@pytest.mark.engine
@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_readme_python_block_runs_as_a_script(index, tiny_family, trained_drafts, tmp_path):
    """The block pasted into a file and run with ``python``, as a user would: vLLM's engine in
    its own process (the default), the tiny family's paths in place of the Hub ids."""
    code = with_tiny_family(blocks("python")[index], tiny_family, trained_drafts)
    assert "nvidia/" not in code
    script = tmp_path / "example.py"
    script.write_text(code, "utf-8")
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the user's default: an engine process
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    out = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip(), out.stderr[-3000:]
