"""The one report writer: every scenario's result is a JSON document plus Markdown tables.

A scenario builds :class:`Table` objects (a title, setup lines, columns, rows of cells and notes)
from its result; :func:`write_report` writes ``<stem>.json`` (the whole result, the tables
included as data) and ``<stem>.md`` (the tables), atomically, so a killed run leaves the last
complete report. The cell helpers format numbers, ranges over repeats and paired ratios the same
way in every table.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    setup: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def add(self, *cells) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(
                f"table {self.title!r}: a row has {len(cells)} cells, expected "
                f"{len(self.columns)} ({self.columns})"
            )
        self.rows.append([_cell(c) for c in cells])

    def markdown(self) -> str:
        lines = [f"## {self.title}", ""]
        lines += [f"- {k}: {v}" for k, v in self.setup.items()]
        if self.setup:
            lines.append("")
        lines.append("| " + " | ".join(self.columns) + " |")
        lines.append("|" + "---|" * len(self.columns))
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        if self.notes:
            lines.append("")
            lines += self.notes
        return "\n".join(lines) + "\n"


def _cell(value) -> str:
    text = "" if value is None else str(value)
    return text.replace("|", "/").replace("\n", " ")


def markdown(title: str, tables: list[Table], preamble: list[str] = ()) -> str:
    parts = [f"# {title}", ""] + list(preamble) + ([""] if preamble else [])
    return "\n".join(parts) + "\n".join(t.markdown() for t in tables)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_report(out: str | Path, stem: str, title: str, result: dict, tables: list[Table]) -> Path:
    """``out/<stem>.json`` (``result`` with the tables) and ``out/<stem>.md``; returns the .md."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    doc = dict(result, tables=[asdict(t) for t in tables])
    _atomic_write(out / f"{stem}.json", json.dumps(doc, indent=1, default=str) + "\n")
    md = out / f"{stem}.md"
    _atomic_write(md, markdown(title, tables))
    return md


# ------------------------------------------------------------------------------------------
# cells


def fmt(value, spec: str = "{:.2f}", missing: str = "") -> str:
    return missing if value is None else spec.format(value)


def clean(values) -> list[float]:
    return [v for v in values or [] if v is not None]


def median(values) -> float | None:
    vals = clean(values)
    return statistics.median(vals) if vals else None


def value_range(values, spec: str = "{:.0f}") -> str:
    """`` [min-max]`` of two or more values, else ""."""
    vals = clean(values)
    if len(vals) < 2:
        return ""
    return f" [{spec.format(min(vals))}-{spec.format(max(vals))}]"


def median_with_range(values, spec: str = "{:.1f}") -> str:
    m = median(values)
    return "" if m is None else spec.format(m) + value_range(values, spec)


def paired_ratios(numerators, denominators) -> list[float] | None:
    """Repeat-by-repeat ratios (repeat k over repeat k: both ran the same prompts and seeds), or
    None when the repeats do not pair up (different counts, a missing value, fewer than one)."""
    a, b = list(numerators or []), list(denominators or [])
    if len(a) != len(b) or not a or any(x is None for x in a + b) or any(y == 0 for y in b):
        return None
    return [x / y for x, y in zip(a, b)]


def ratio_cell(numerators, denominators) -> str:
    """The median [min-max] of the paired ratios; the ratio of the medians (marked ``~``) when
    the repeats do not pair; "" when either side is missing."""
    ratios = paired_ratios(numerators, denominators)
    if ratios is not None:
        return median_with_range(ratios, "{:.2f}")
    a, b = median(numerators), median(denominators)
    if a is None or not b:
        return ""
    return f"~{a / b:.2f}"
