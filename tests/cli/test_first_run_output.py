"""What ``make-tiny`` and ``demo`` print tells a user where the models are (absolute paths, the
trained drafts named as such) and how to serve them (float32, as the family is stored)."""

from __future__ import annotations

import json
import shlex

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
