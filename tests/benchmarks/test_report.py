"""benchmarks/harness/report.py: the table writer and the cells every scenario shares."""

from __future__ import annotations

import json

import pytest

from benchmarks.harness import report


def test_paired_ratios_pair_repeat_k_with_repeat_k():
    assert report.paired_ratios([110, 90, 100], [100, 100, 80]) == [1.1, 0.9, 1.25]
    assert report.ratio_cell([110, 90, 100], [100, 100, 80]) == "1.10 [0.90-1.25]"


@pytest.mark.parametrize(
    "a, b", [([1, 2], [1, 2, 3]), ([1, None], [1, 2]), ([1, 2], [0, 2]), ([], [])]
)
def test_unpaired_repeats_give_no_paired_ratios(a, b):
    assert report.paired_ratios(a, b) is None


def test_ratio_cell_falls_back_to_the_ratio_of_medians_and_marks_it():
    assert report.ratio_cell([120, 100], [100, 90, 110]) == "~1.10"
    assert report.ratio_cell([120], None) == ""


def test_cells():
    assert report.median_with_range([3.0, 1.0, 2.0]) == "2.0 [1.0-3.0]"
    assert report.median_with_range([5.0, None]) == "5.0"
    assert report.median_with_range([]) == ""
    assert report.fmt(None) == "" and report.fmt(1.234) == "1.23"


def test_a_row_must_have_every_column():
    t = report.Table("t", ["a", "b"])
    with pytest.raises(ValueError, match="a row has 1 cells, expected 2"):
        t.add("x")


def test_write_report_renders_tables_and_keeps_the_result(tmp_path):
    t = report.Table("Per arm", ["arm", "tok/s"], setup={"target": "x"}, notes=["a note"])
    t.add("plain", "1|2")
    t.add("dspark3", None)
    md = report.write_report(tmp_path, "speed", "speed: title", {"arms": {"plain": 1}}, [t])
    text = md.read_text()
    assert text.startswith("# speed: title\n")
    assert "- target: x" in text and "| plain | 1/2 |" in text and "| dspark3 |  |" in text
    assert text.rstrip().endswith("a note")
    doc = json.loads((tmp_path / "speed.json").read_text())
    assert doc["arms"] == {"plain": 1} and doc["tables"][0]["rows"][0] == ["plain", "1/2"]
    assert not list(tmp_path.glob("*.tmp"))
