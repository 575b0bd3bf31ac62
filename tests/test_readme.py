"""The README's commands work as written: every ``vllm-nemotron-spec`` command line parses, the
``vllm bench serve`` lines parse with vLLM's own parser and are greedy, and the python blocks run
as scripts on this machine with the tiny family in place of the Nemotron 3.5 checkpoints."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"

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


@pytest.mark.parametrize("argv", readme_commands("vllm-nemotron-spec"), ids=" ".join)
def test_readme_cli_command_parses(argv):
    from vllm_nemotron_spec.cli.main import build_parser

    args, extra = build_parser().parse_known_args(argv)
    assert args.command == argv[0]
    assert not extra or getattr(args, "accepts_extra_args", False), extra


def bench_serve_commands() -> list[list[str]]:
    """``vllm bench serve`` lines, plain or through the passthrough."""
    out = []
    for argv in readme_commands("vllm") + [
        a[1:] for a in readme_commands("vllm-nemotron-spec") if a[0] == "vllm"
    ]:
        if argv[:2] == ["bench", "serve"]:
            out.append(argv[2:])
    return out


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
    code = blocks("python")[index]
    for hub_id, path in (
        (f"{TARGET_ID}-DFlash", trained_drafts.dflash),
        (f"{TARGET_ID}-DSpark", trained_drafts.dspark),
        (TARGET_ID, tiny_family.target),
    ):
        code = code.replace(hub_id, str(path))
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
