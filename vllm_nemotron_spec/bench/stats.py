"""Results of one benchmark run and the JSON report built from them.

A :class:`RunStats` is what one method did on the prompt set; :func:`make_report` turns a list of
them into the report that ``--json`` prints (schema in ``docs/bench.md``). The acceptance-length
histogram can be derived from vLLM's per-position counters (:func:`histogram_from_counters`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from vllm_nemotron_spec.runs import SpecCounters

SCHEMA = "vllm-nemotron-spec.bench/1"


class BenchError(ValueError):
    """A bad method spec, server URL or option; the message says what was expected."""


@dataclass
class RunStats:
    """What one method did on the prompt set (one row of the report)."""

    label: str
    method: str
    draft: str | None = None
    num_speculative_tokens: int | None = None
    status: str = "ok"  # ok | unsupported | error
    error: str | None = None
    num_prompts: int = 0
    output_tokens: int = 0
    seconds: float = 0.0
    tpot_ms: list[float] = field(default_factory=list)  # per request
    ttft_ms: list[float] = field(default_factory=list)  # per request
    timing_source: str = ""
    counters: SpecCounters | None = None  # spec-decode counter deltas (None: not speculative)
    histogram: list[int] | None = None  # steps by accepted drafts (index 0..K)
    histogram_source: str | None = None
    token_ids: list[list[int]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float | None:
        return self.output_tokens / self.seconds if self.seconds > 0 else None


def histogram_from_counters(counters: SpecCounters) -> list[int] | None:
    """Steps with exactly k accepted drafts, k = 0..K, from the per-position counters: a draft
    token is accepted only after every earlier one was, so
    ``steps(k) = accepted_pos[k-1] - accepted_pos[k]`` (``accepted_pos[-1]`` = number of drafts,
    ``accepted_pos[K]`` = 0). Sums to the number of drafts. None when there is nothing to derive
    or the counters are inconsistent."""
    pos = list(counters.accepted_per_position)
    if counters.num_drafts <= 0 or not pos:
        return None
    bounds = [counters.num_drafts] + pos + [0]
    hist = [int(bounds[k] - bounds[k + 1]) for k in range(len(pos) + 1)]
    return hist if all(h >= 0 for h in hist) else None


def add_histograms(total: list[int] | None, one: list[int]) -> list[int]:
    total = list(total or [])
    if len(total) < len(one):
        total += [0] * (len(one) - len(total))
    for i, v in enumerate(one):
        total[i] += int(v)
    return total


def first_mismatch(a: list[list[int]], b: list[list[int]]) -> int | None:
    """Index of the first prompt whose tokens differ (None: identical)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _r(value: float | None, digits: int = 4) -> float | None:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return None
    return round(float(value), digits)


def run_to_json(run: RunStats, reference: RunStats | None, compare_tokens: bool) -> dict:
    """One entry of ``report["runs"]`` (see docs/bench.md for the schema)."""
    c = run.counters
    ok = run.status == "ok"
    ref_ok = reference is not None and reference.status == "ok"
    speedup = None
    if ok and ref_ok and run.tokens_per_s and reference.tokens_per_s:
        speedup = run.tokens_per_s / reference.tokens_per_s
    matches = mismatch = None
    if ok and ref_ok and compare_tokens and run is not reference:
        mismatch = first_mismatch(run.token_ids, reference.token_ids)
        matches = mismatch is None
    has_spec = ok and c is not None and c.num_drafts > 0
    return {
        "label": run.label,
        "method": run.method,
        "draft": run.draft,
        "num_speculative_tokens": run.num_speculative_tokens,
        "status": run.status,
        "error": run.error,
        "num_prompts": run.num_prompts,
        "output_tokens": run.output_tokens if ok else None,
        "seconds": _r(run.seconds) if ok else None,
        "tokens_per_s": _r(run.tokens_per_s, 2) if ok else None,
        "speedup_vs_plain": _r(speedup, 3),
        "mean_tpot_ms": _r(_mean(run.tpot_ms), 3) if ok else None,
        "mean_ttft_ms": _r(_mean(run.ttft_ms), 3) if ok else None,
        "timing_source": run.timing_source if ok else None,
        "num_drafts": c.num_drafts if ok and c is not None else None,
        "num_draft_tokens": c.num_draft_tokens if ok and c is not None else None,
        "num_accepted_tokens": c.num_accepted_tokens if ok and c is not None else None,
        "draft_acceptance_rate": (
            _r(c.num_accepted_tokens / c.num_draft_tokens)
            if has_spec and c.num_draft_tokens
            else None
        ),
        "mean_acceptance_length": _r(c.mean_acceptance_length) if has_spec else None,
        "accepted_per_position": list(c.accepted_per_position) if has_spec else None,
        "per_position_acceptance": (
            [_r(x) for x in c.per_position_acceptance] if has_spec else None
        ),
        "acceptance_histogram": list(run.histogram) if has_spec and run.histogram else None,
        "acceptance_histogram_source": run.histogram_source if has_spec and run.histogram else None,
        "matches_plain": matches,
        "first_mismatching_prompt": mismatch,
    }


def make_report(
    runs: list[RunStats],
    *,
    mode: str,
    model: str,
    prompts,
    num_prompts: int,
    max_tokens: int,
    temperature: float,
    ignore_eos: bool,
    platform: str,
    vllm_version: str | None,
    extra: dict | None = None,
) -> dict:
    """The JSON-able report: header + one entry per run. The reference for speedup and the
    token comparison is the first run whose method is plain."""
    reference = next((r for r in runs if r.method == "plain"), None)
    compare = temperature == 0.0
    report = {
        "schema": SCHEMA,
        "mode": mode,
        "vllm_version": vllm_version,
        "platform": platform,
        "model": model,
        "prompts": {"source": prompts.source, "key": prompts.key, "num_prompts": num_prompts},
        "max_tokens": max_tokens,
        "temperature": temperature,
        "ignore_eos": ignore_eos,
        "reference": reference.label if reference is not None else None,
        "runs": [run_to_json(r, reference, compare) for r in runs],
    }
    if extra:
        report.update(extra)
    return report
