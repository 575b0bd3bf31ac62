"""What ``make-tiny`` and ``demo`` print tells a user where the models are (absolute paths, the
trained drafts named as such) and how to serve them (float32, as the family is stored), and the
demo's first run prints progress and results, not warnings."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_nemotron_spec.cli import demo
from vllm_nemotron_spec.cli import main as cli


def test_demo_report_names_the_trained_drafts_and_a_serve_line(tmp_path):
    report = {
        "vllm_version": "0.32.0",
        "platform": "cpu",
        "family": str(tmp_path / "fam"),
        "target": str(tmp_path / "fam" / "target"),
        "drafts": {
            "dflash": str(tmp_path / "tiny-drafts-trained-seed0" / "dflash"),
            "dspark": str(tmp_path / "tiny-drafts-trained-seed0" / "dspark"),
        },
        "max_tokens": 8,
        "runs": [
            {
                "method": "plain",
                "num_prompts": 1,
                "output_tokens": 8,
                "tokens_per_s": 1.0,
                "mean_acceptance_length": None,
                "lossless": True,
                "first_mismatching_prompt": None,
            }
        ],
    }
    text = demo.format_report(report)
    assert f"dflash draft (trained against the target): {report['drafts']['dflash']}" in text
    assert f"dspark draft (trained against the target): {report['drafts']['dspark']}" in text
    serve = next(line for line in text.splitlines() if line.startswith("serve: "))
    argv = shlex.split(serve[len("serve: ") :])
    assert argv[:4] == ["vllm-nemotron-spec", "vllm", "serve", report["target"]]
    assert argv[argv.index("--dtype") + 1] == "float32"
    config = json.loads(argv[argv.index("--speculative-config") + 1])
    # vLLM refuses a DFlash draft without block_size unless num_speculative_tokens is given
    assert config == {
        "method": "dflash",
        "model": report["drafts"]["dflash"],
        "num_speculative_tokens": 5,
    }
    report["runs"].append(dict(report["runs"][0], method="dflash", num_speculative_tokens=3))
    serve = next(line for line in demo.format_report(report).splitlines() if "serve: " in line)
    assert '"num_speculative_tokens": 3' in serve


def test_make_tiny_prints_absolute_paths_and_trained_drafts(monkeypatch, tmp_path, capsys):
    from vllm_nemotron_spec.tiny import build, train_draft

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(
        build,
        "build_tiny_family",
        lambda outdir, seed=0, force=False, progress=True: build.TinyFamily.at(outdir),
    )
    trained_root = tmp_path / "tiny-drafts-trained-seed3"
    monkeypatch.setattr(
        train_draft,
        "ensure_trained_drafts",
        lambda seed=0, family=None, progress=True: train_draft.TrainedDrafts.at(trained_root),
    )
    assert cli.main(["make-tiny", "rel", "--seed", "3", "--trained", "--quiet"]) == 0
    out = capsys.readouterr().out.splitlines()
    fields = {line.split(":", 1)[0]: line.split(":", 1)[1].strip() for line in out}
    assert fields["target"] == str(tmp_path / "rel" / "target")
    assert fields["dflash"] == f"{tmp_path / 'rel' / 'dflash'}  (untrained)"
    assert fields["trained dflash"] == str(trained_root / "dflash")
    assert fields["trained dspark"] == str(trained_root / "dspark")
    argv = shlex.split(fields["serve"])
    assert argv[3] == str(tmp_path / "rel" / "target")
    config = json.loads(argv[argv.index("--speculative-config") + 1])
    assert config["model"] == str(trained_root / "dflash")
    assert config["num_speculative_tokens"] == 5  # vLLM requires it for this DFlash draft


def test_vllm_passthrough_hands_help_to_vllm():
    """``vllm-nemotron-spec vllm bench serve --help`` shows vLLM's help, not the passthrough's."""
    args, extra = cli.build_parser().parse_known_args(["vllm", "bench", "serve", "--help"])
    assert args.command == "vllm" and extra == ["bench", "serve", "--help"]


def test_build_steps_fix_their_thread_count_after_vllms_cpu_worker_started(monkeypatch):
    """vLLM's in-process CPU worker replaces ``torch.set_num_threads`` with a stub that only logs
    "CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding" (85 such
    lines when drafts were trained after an engine ran, and the training then ran at another
    thread count than its cache key says). The build steps still set and restore their thread
    count, without calling the stub."""
    import torch

    from vllm_nemotron_spec._torch import deterministic_torch, torch_threads

    stub_calls = []
    monkeypatch.setattr(torch, "set_num_threads", stub_calls.append)
    before = torch.get_num_threads()
    wanted = 1 if before != 1 else 2
    for step in (deterministic_torch, torch_threads):
        with step(wanted):
            assert torch.get_num_threads() == wanted
        assert torch.get_num_threads() == before
    assert stub_calls == []


ENV_NAME_IN_PYTHON = re.compile(r"[\"'](VLLM_[A-Z0-9_]+)[\"']")
ENV_NAME_IN_SHELL = re.compile(r"\b(VLLM_[A-Z0-9_]+)")


def test_the_packages_environment_variables_are_outside_vllms_prefix():
    """vLLM warns "Unknown vLLM environment variable detected" for every ``VLLM_`` variable it
    does not know, in each of its processes: every ``VLLM_`` name the package, the test
    environment, the scripts and CI use is one of vLLM's own."""
    import vllm.envs

    repo = Path(__file__).resolve().parents[2]
    files = [*(repo / "vllm_nemotron_spec").rglob("*.py"), repo / "tests" / "conftest.py"]
    files += [p for p in (repo / "scripts").rglob("*") if p.is_file()] + [repo / ".ci" / "run"]
    used = set()
    for path in files:
        # Python: a quoted name (os.environ.get("VLLM_X")); shell scripts: any
        pattern = ENV_NAME_IN_PYTHON if path.suffix == ".py" else ENV_NAME_IN_SHELL
        used |= {(name, str(path.relative_to(repo))) for name in pattern.findall(path.read_text())}
    known = set(vllm.envs.environment_variables)
    unknown = sorted((name, where) for name, where in used if name not in known)
    assert not unknown, f"VLLM_ names vLLM does not know: {unknown}"


LOGGED_WARNING = re.compile(r"\bWARNING\b|^\[W\d{4} ")
"""A line logged at WARNING level (vLLM's format: ``WARNING 12-05 18:55:32 [file.py:140] ...``)
or a torch C++ warning (``[W1205 20:04:45.707 utils.cpp:68] Warning: ...``)."""
PYTHON_WARNING = re.compile(r"\.py:\d+: \w*Warning: ")
"""A Python warning as printed: ``path.py:47: FutureWarning: ...``."""


@pytest.fixture(scope="module")
def demo_output(tiny_family, tiny_seed) -> str:
    """What ``vllm-nemotron-spec demo`` (the README's first command) prints on the built family,
    stdout and stderr."""
    from vllm_nemotron_spec.tiny.train_draft import ensure_trained_drafts

    ensure_trained_drafts(family=tiny_family)  # the demo's own first run trains them
    env = dict(os.environ)
    env.pop("PYTHONWARNINGS", None)
    assert "NEMOTRON_SPEC_CACHE" in env  # a variable of the package reaches every vLLM process
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_nemotron_spec.cli.main", "demo", "--seed", str(tiny_seed),
         "--num-prompts", "2", "--max-tokens", "8"],
        cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "all speculative runs match plain decoding" in proc.stdout, output[-4000:]
    return output


def _lines(output: str, pattern: re.Pattern) -> list[str]:
    return [line for line in re.split(r"[\r\n]+", output) if pattern.search(line)]


@pytest.mark.engine
def test_demo_logs_no_warning(demo_output):
    """No logged warning and no torch C++ warning: the plugin's warnings show, vLLM's are about
    the engines the demo configures itself and are left out (``cli/demo.py:
    PluginWarningsOnly``; ``--verbose`` shows them)."""
    lines = _lines(demo_output, LOGGED_WARNING)
    assert not lines, f"{len(lines)} warning line(s):\n" + "\n".join(lines[:20])


@pytest.mark.engine
def test_demo_raises_no_python_warning(demo_output):
    """e.g. the FutureWarnings of torch.distributed.reduce_op that vLLM's kernel-override scan
    touches (patches/cpu_kernel_rebind.py keeps them out)."""
    lines = _lines(demo_output, PYTHON_WARNING)
    assert not lines, f"{len(lines)} Python warning line(s):\n" + "\n".join(lines[:20])
