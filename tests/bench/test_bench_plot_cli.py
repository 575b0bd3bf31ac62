"""``bench --plot``: without matplotlib it stops before any engine starts, with one line saying
what to install; a plot that fails after the runs never loses the printed results."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from vllm_nemotron_spec import bench
from vllm_nemotron_spec.bench import RunStats
from vllm_nemotron_spec.prompts import PromptSet
from vllm_nemotron_spec.runs import SpecCounters


def test_plot_without_matplotlib_fails_before_any_engine(tmp_path):
    family_dir = tmp_path / "family"
    script = textwrap.dedent(f"""
        import sys
        sys.modules["matplotlib"] = None  # not importable, as on an install without it
        from vllm_nemotron_spec.cli.main import main
        code = main(["bench", "--family-dir", {str(family_dir)!r}, "--plot",
                     {str(tmp_path / "b.png")!r}])
        print("EXIT", code, "VLLM_IMPORTED", "vllm" in sys.modules, "TORCH_IMPORTED",
              "torch" in sys.modules)
    """)
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["EXIT", "2", "VLLM_IMPORTED", "False", "TORCH_IMPORTED", "False"]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("vllm-nemotron-spec bench: --plot needs matplotlib")
    assert "pip install matplotlib" in lines[0]
    assert not family_dir.exists() and not (tmp_path / "b.png").exists()


def fake_report() -> dict:
    plain = RunStats(
        "plain",
        "plain",
        num_prompts=2,
        output_tokens=40,
        seconds=2.0,
        tpot_ms=[10.0],
        timing_source="request_metrics",
        token_ids=[[1], [2]],
    )
    spec = RunStats(
        "dflash",
        "dflash",
        "/d",
        3,
        num_prompts=2,
        output_tokens=40,
        seconds=1.0,
        tpot_ms=[5.0],
        timing_source="request_metrics",
        token_ids=[[1], [2]],
        counters=SpecCounters(4, 12, 6, [3, 2, 1]),
        histogram=[1, 1, 1, 1],
        histogram_source="per_position_counters",
    )
    return bench.make_report(
        [plain, spec],
        mode="offline",
        model="/m/target",
        prompts=PromptSet(("a", "b"), "test"),
        num_prompts=2,
        max_tokens=20,
        temperature=0.0,
        ignore_eos=False,
        platform="cpu",
        vllm_version="0.0",
    )


def test_failing_plot_keeps_the_printed_results(monkeypatch, capsys, tmp_path):
    from vllm_nemotron_spec.cli import bench as cli_bench
    from vllm_nemotron_spec.cli.main import main

    report = fake_report()

    def broken_plot(report, path):
        raise OSError(f"cannot write {path}")

    monkeypatch.setattr(cli_bench, "build_report", lambda args: report)
    monkeypatch.setattr(bench, "plot_report", broken_plot)
    code = main(["bench", "--json", "--plot", str(tmp_path / "b.png")])
    out, err = capsys.readouterr()
    assert code == 1
    assert json.loads(out) == report
    assert err.strip().splitlines() == [
        f"vllm-nemotron-spec bench: --plot {tmp_path / 'b.png'}: OSError: cannot write "
        f"{tmp_path / 'b.png'}"
    ]


def test_plot_labels_every_length_and_k(tmp_path, monkeypatch):
    """The histogram's x axis names every acceptance length 1..K+1; legends carry K; the speed
    panel lists every timed method."""
    import matplotlib.pyplot as plt  # the test extra

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    bench.plot_report(fake_report(), tmp_path / "b.png")
    left, mid, right = figures[0].axes
    assert [t.get_text() for t in mid.get_xticklabels()] == ["1", "2", "3", "4"]
    assert [t.get_text() for t in mid.get_legend().get_texts()] == ["dflash (K=3)"]
    assert left.get_legend().get_texts()[0].get_text() == "dflash (K=3, accept len 2.50)"
    assert [t.get_text() for t in right.get_yticklabels()] == ["plain", "dflash (K=3)"]


def test_vllm_logs_quiet_during_bench_and_restored(monkeypatch):
    """By default vLLM logs WARNING and above while bench runs (here and in engine processes,
    through VLLM_LOGGING_LEVEL); --verbose or the user's own VLLM_LOGGING_LEVEL leaves them."""
    import logging
    import os

    from vllm_nemotron_spec.cli.bench import vllm_log_level

    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    logger = logging.getLogger("vllm")
    monkeypatch.setattr(logger, "level", logging.INFO)
    with vllm_log_level("WARNING"):
        assert os.environ["VLLM_LOGGING_LEVEL"] == "WARNING"
        assert not logger.isEnabledFor(logging.INFO) and logger.isEnabledFor(logging.WARNING)
    assert "VLLM_LOGGING_LEVEL" not in os.environ and logger.level == logging.INFO
    with vllm_log_level(None):  # --verbose
        assert "VLLM_LOGGING_LEVEL" not in os.environ and logger.level == logging.INFO
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    with vllm_log_level("WARNING"):
        assert os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG" and logger.level == logging.INFO
