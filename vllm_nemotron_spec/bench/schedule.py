"""Per-batch-size speculation schedules: expected throughput, the choice of k, vLLM's ranges.

Pure Python; used by ``tune`` (:mod:`vllm_nemotron_spec.bench.tune`). The model behind the
numbers:

* ``per_position[j]`` is the share of drafting steps whose drafts 1..j+1 were all accepted (vLLM's
  per-position accepted counter over its number of drafts). A draft is accepted only after every
  earlier one was, and the plugin's proposers (and vLLM's V2 runner) draft the whole block and keep
  the first k, so with k drafts a step accepts ``min(k, accepted of the whole block)`` tokens:
  ``E[accepted | k] = per_position[0] + ... + per_position[k-1]``.
* A step of a batch of B requests emits ``B * (1 + E[accepted | k])`` tokens in ``step(B, k)``
  seconds, so the expected output rate is ``B * (1 + E[accepted | k]) / step(B, k)``.
* vLLM's schedule ``num_speculative_tokens_per_batch_size`` is a list of inclusive ranges
  ``[start, end, k]``, the first starting at 1; batch sizes in a gap or past the last range keep
  the previous range's k, and every k is capped by ``num_speculative_tokens``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from vllm_nemotron_spec.bench.stats import BenchError


class ScheduleError(BenchError):
    """Measurements or a schedule that cannot be used; the message says what was expected."""


def batch_grid(max_batch: int) -> list[int]:
    """Batch sizes to measure: 1, 2, 4, ... (powers of two) up to ``max_batch``, which is
    always included."""
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ScheduleError(f"--max-batch must be an integer >= 1, found {max_batch!r}")
    grid, b = [], 1
    while b < max_batch:
        grid.append(b)
        b *= 2
    return grid + [max_batch]


def check_per_position(per_position: Sequence[float]) -> list[float]:
    """``per_position`` as floats, checked: each in [0, 1] and non-increasing (drafts 1..j+1 all
    accepted implies drafts 1..j all accepted)."""
    rates = [float(x) for x in per_position]
    for j, x in enumerate(rates):
        if not 0.0 <= x <= 1.0:
            raise ScheduleError(
                f"per-position acceptance[{j}] must lie in [0, 1], found {x} ({rates})"
            )
        if j and x > rates[j - 1] + 1e-12:
            raise ScheduleError(
                f"per-position acceptance must not increase with the position: "
                f"[{j - 1}] = {rates[j - 1]} < [{j}] = {x}"
            )
    return rates


def expected_accepted(per_position: Sequence[float], k: int) -> float:
    """``E[accepted drafts | k drafts]`` = the sum of the first k per-position rates."""
    rates = check_per_position(per_position)
    if k < 0 or k > len(rates):
        raise ScheduleError(
            f"k = {k}: acceptance was measured for positions 1..{len(rates)}, expected "
            f"0 <= k <= {len(rates)}"
        )
    return sum(rates[:k])


def expected_tokens_per_s(
    batch: int, per_position: Sequence[float], k: int, step_seconds: float
) -> float:
    """Output tokens/s of a batch of ``batch`` requests drafting ``k`` tokens per step, a step
    taking ``step_seconds``: ``batch * (1 + E[accepted | k]) / step_seconds``."""
    if batch < 1:
        raise ScheduleError(f"batch size must be >= 1, found {batch}")
    if not step_seconds > 0:
        raise ScheduleError(f"step time of batch {batch}, k {k} must be > 0, found {step_seconds}")
    return batch * (1.0 + expected_accepted(per_position, k)) / step_seconds


def rate_table(
    per_position: Sequence[float], step_seconds: Mapping[tuple[int, int], float]
) -> dict[tuple[int, int], float]:
    """Expected output tokens/s for every measured ``(batch, k)`` of ``step_seconds``."""
    return {
        (b, k): expected_tokens_per_s(b, per_position, k, s)
        for (b, k), s in sorted(step_seconds.items())
    }


def choose_k(rates: Mapping[int, float]) -> int:
    """The k with the highest expected tokens/s; on a tie the smallest (fewer drafts per step
    cost less memory and verification work for the same throughput)."""
    if not rates:
        raise ScheduleError("no k was measured for this batch size")
    return min(rates, key=lambda k: (-rates[k], k))


def choose_schedule(rates: Mapping[tuple[int, int], float]) -> dict[int, int]:
    """For each batch size in ``rates`` (keyed ``(batch, k)``), the k that maximises it."""
    batches = sorted({b for b, _ in rates})
    return {b: choose_k({k: r for (bb, k), r in rates.items() if bb == b}) for b in batches}


def merge_ranges(choice: Mapping[int, int]) -> list[list[int]]:
    """vLLM's ranges for a choice made at grid batch sizes: each grid size's k holds from it up to
    the next grid size minus one (the last up to itself; vLLM keeps the last k beyond it), and
    neighbouring ranges with the same k merge. The grid must include batch size 1."""
    if not choice:
        raise ScheduleError("no batch size was measured")
    batches = sorted(choice)
    if batches[0] != 1:
        raise ScheduleError(
            f"the measured batch sizes must start at 1 (vLLM's first range does), found "
            f"{batches[0]}"
        )
    ranges: list[list[int]] = []
    for i, b in enumerate(batches):
        end = batches[i + 1] - 1 if i + 1 < len(batches) else b
        k = int(choice[b])
        if ranges and ranges[-1][2] == k:
            ranges[-1][1] = end
        else:
            ranges.append([b, end, k])
    return ranges


def k_for_batch(ranges: Sequence[Sequence[int]], batch: int, num_speculative_tokens: int) -> int:
    """The k vLLM uses at ``batch`` under ``ranges`` (gaps and the tail keep the previous k,
    every k capped by ``num_speculative_tokens``)."""
    k = None
    for start, end, value in sorted(ranges):
        if start > batch:
            break
        k = value
    if k is None:
        raise ScheduleError(f"batch size {batch} is below the first range {sorted(ranges)[0]}")
    return min(k, num_speculative_tokens)


def speculative_config(
    method: str, model: str, ranges: Sequence[Sequence[int]], extra: Mapping | None = None
) -> dict | None:
    """The ``--speculative-config`` that serves ``ranges``: ``num_speculative_tokens`` = the
    largest k (the block drafted every step) and ``num_speculative_tokens_per_batch_size`` =
    ``ranges``. None when every k is 0 (no drafts pay at any batch size: serve plain decoding).
    ``extra`` (e.g. an attention backend) is merged in."""
    ks = [int(r[2]) for r in ranges]
    if not ks:
        raise ScheduleError("empty schedule")
    if max(ks) == 0:
        return None
    return {
        "method": method,
        "model": model,
        **(extra or {}),
        "num_speculative_tokens": max(ks),
        "num_speculative_tokens_per_batch_size": [[int(x) for x in r] for r in ranges],
    }
