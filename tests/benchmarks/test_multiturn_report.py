"""benchmarks/gpu_multiturn.py's report with several servers per row: each server is compared
with the same-numbered server of the other rows, and the rows are summarised across servers."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_multiturn.py"
_spec = importlib.util.spec_from_file_location("gpu_multiturn", _PATH)
mt = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("gpu_multiturn", mt)
_spec.loader.exec_module(mt)


def _run(row, k, tok_s):
    return {
        "name": mt.instance_name(row, k, 3),
        "row": row,
        "status": "ok",
        "concurrency": [{"concurrency": 1, "output_tok_s": tok_s}],
    }


def test_instance_names():
    assert mt.instance_name("plain", 0, 1) == "plain"
    assert mt.instance_name("dspark7-ours", 1, 3) == "dspark7-ours#2"


def test_servers_are_compared_in_turn_and_summarised():
    ours = [500.0, 600.0, 560.0]
    upstream = [400.0, 700.0, 520.0]
    runs = [_run("dspark7-ours", k, t) for k, t in enumerate(ours)]
    runs += [_run("dspark7-upstream", k, t) for k, t in enumerate(upstream)]
    runs.append({"name": "dspark7-ours#4", "row": "dspark7-ours", "status": "skipped: time budget"})
    md = mt.markdown({"setup": {}, "runs": runs})
    lines = md.splitlines()
    # server k of ours against server k of vLLM alone
    assert any(line.startswith("| dspark7-ours#1 | 1 | 500.0 |  | 1.25 |") for line in lines), md
    assert any(line.startswith("| dspark7-ours#2 | 1 | 600.0 |  | 0.86 |") for line in lines), md
    # across servers: medians 560 and 520, ratio 1.08, ranges and counts
    assert "| dspark7-ours | 1 | 560.0 [500-600] | 1.08 | 3 |" in lines, md
    assert "| dspark7-upstream | 1 | 520.0 [400-700] |  | 3 |" in lines, md


def test_one_server_per_row_has_no_summary():
    runs = [
        {
            "name": "dflash5-ours",
            "status": "ok",
            "concurrency": [{"concurrency": 1, "output_tok_s": 2.0}],
        },
        {
            "name": "dflash5-upstream",
            "status": "ok",
            "concurrency": [{"concurrency": 1, "output_tok_s": 1.0}],
        },
    ]
    md = mt.markdown({"setup": {}, "runs": runs})
    assert "Across servers" not in md
    assert any(
        line.startswith("| dflash5-ours | 1 | 2.0 |  | 2.00 |") for line in md.splitlines()
    ), md
