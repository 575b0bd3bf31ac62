"""Exactness and prefix-cache hits under the published serving recipe's flags, through real
``vllm serve`` processes on 127.0.0.1 (tiny family, trained drafts, greedy, multi-turn).

    python3 benchmarks/gpu_recipe_check.py --out DIR                    # H200: ~4-7 minutes
    python3 benchmarks/gpu_recipe_check.py --out DIR --family CACHE     # carried tiny family
    python3 benchmarks/gpu_recipe_check.py --out DIR --device cpu       # CPU: plain vs DSpark
    python3 benchmarks/gpu_recipe_check.py --out DIR --shape flashinfer # FlashInfer's head sizes

A configuration is ``VARIANT@FLAGS``. Variants: ``plain``; ``dflash`` / ``dspark`` (the tiny
family's trained drafts, 3 drafted tokens, plugin loaded); ``dflash-upstream`` /
``dspark-upstream`` (the same drafts with vLLM alone: ``VLLM_PLUGINS=""``). DFlash asks for the
FLASHINFER draft attention backend (``speculative_config.attention_backend``) when FlashInfer is
importable; if that server does not start, it is started again with vLLM's default and both are
recorded. Flag sets:

    base     the engine defaults (on CPU the tiny-family settings, prefix caching off)
    prefix   --enable-prefix-caching --mamba-cache-mode align
    fp8      prefix + --kv-cache-dtype fp8
    recipe   fp8 + --mamba-backend flashinfer (only where vLLM has the flag and FlashInfer imports)

Defaults: on CUDA every variant @prefix, plain/dflash/dspark @fp8 and @recipe (13 servers); on
CPU plain and dspark @base. The servers of one flag set start together (tiny models, a small
fixed KV cache each: ``--kv-cache-memory-bytes``), then each runs the workload; start-up
dominates (on the H200 ~40-80 s with ``--enforce-eager``, the default here: exactness does not
need CUDA graphs, and compiling them would cost ~60 s more per server; ``--no-eager`` to use them).

Workload: ``--conversations`` greedy conversations of ``--turns`` turns, run at once; turn 1's
prompt is a corpus window of ``--first-tokens`` tokens, each later turn's prompt is the previous
prompt + that server's answer + ``--user-tokens`` new corpus tokens (token ids, so prefixes are
exact), ``--max-tokens`` output tokens each (ignore_eos). Per configuration and turn: every output
token compared with plain decoding served with the same flags (first mismatch, and the plain
server's top-2 logprob gap there: a near-tie or not), ``vllm:prefix_cache_hits`` /
``vllm:prefix_cache_queries`` deltas, spec-decode acceptance. A configuration is exact when every
turn of every conversation equals plain's. Where vLLM alone served the same draft with the same
flags (``dflash-upstream@X`` beside ``dflash@X``), the plugin's outputs and hits are also compared
with vLLM alone's, token for token.

``--shape flashinfer``: the tiny family with the real model's head sizes, for which FlashInfer has
kernels (attention heads of 128, Mamba heads of 64 with a 128-wide state; the default family's
32-wide attention and 16-wide Mamba heads have none), its own trained drafts (built and trained on
first use, ~10 minutes of CPU, under ``CACHE/flashinfer/``), and by default on CUDA the @fp8 and
@recipe sets with vLLM alone beside the plugin at @recipe.

Writes DIR/recipe_check.json, DIR/recipe_check.md, DIR/logs/<config>.log; prints one verdict line
(``RECIPE CHECK: PASS ...`` / ``FAIL ...``). Exit 0 when every configuration with the plugin
that started is exact and has plain's prefix-cache hits turn for turn, or, where vLLM alone ran
beside it, has vLLM alone's outputs and hits turn for turn (on the H200 in bf16, speculative
decoding parts from plain at near-ties with and without the plugin; upstream rows and refusals
are reported, not judged).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common
from _common import http, serve

NUM_SPECULATIVE_TOKENS = 3
VARIANTS = {  # name: (method, plugin)
    "plain": (None, True),
    "dflash": ("dflash", True),
    "dspark": ("dspark", True),
    "dflash-upstream": ("dflash", False),
    "dspark-upstream": ("dspark", False),
}
FLAG_SETS = {
    "base": (),
    "prefix": _common.PREFIX_FLAGS,
    "fp8": _common.RECIPE_FLAGS,
    "recipe": _common.RECIPE_FLAGS + _common.FLASHINFER_MAMBA_FLAGS,
}
DEFAULT_GPU = (
    "plain@prefix,dflash@prefix,dspark@prefix,dflash-upstream@prefix,dspark-upstream@prefix,"
    "plain@fp8,dflash@fp8,dspark@fp8,plain@recipe,dflash@recipe,dspark@recipe"
)
DEFAULT_CPU = "plain@base,dspark@base"
DEFAULT_FLASHINFER_SHAPE = (
    "plain@fp8,dflash@fp8,dspark@fp8,plain@recipe,dflash@recipe,dspark@recipe,"
    "dflash-upstream@recipe,dspark-upstream@recipe"
)


def flashinfer_shaped_spec():
    """The tiny family's parameters with FlashInfer-served head sizes (those of the real model:
    attention 128, Mamba 64 x state 128); everything else as the default family."""
    from vllm_nemotron_spec.tiny.build import TinySpec
    from vllm_nemotron_spec.tiny.drafts import DraftParams
    from vllm_nemotron_spec.tiny.target import TargetParams

    return TinySpec(
        target=TargetParams(head_dim=128, mamba_head_dim=64, ssm_state_size=128),
        draft=DraftParams(head_dim=128),
    )


REFUSAL = re.compile(r"^(ValueError|NotImplementedError|TypeError|vllm serve: error)")
"""A start-up error that is a refusal of the configuration (one line naming what is wrong), not
a crash."""


@dataclass
class Config:
    variant: str
    flags: str

    @property
    def name(self) -> str:
        return f"{self.variant}@{self.flags}"

    @property
    def method(self) -> str | None:
        return VARIANTS[self.variant][0]

    @property
    def plugin(self) -> bool:
        return VARIANTS[self.variant][1]


def parse_configs(text: str) -> list[Config]:
    out = []
    for item in [x.strip() for x in text.split(",") if x.strip()]:
        variant, _, flags = item.partition("@")
        if variant not in VARIANTS or flags not in FLAG_SETS:
            raise SystemExit(
                f"--configs: {item!r} is not VARIANT@FLAGS with VARIANT in {list(VARIANTS)} "
                f"and FLAGS in {list(FLAG_SETS)}"
            )
        out.append(Config(variant, flags))
    return out


# ------------------------------------------------------------------------------------------
# Workload


@dataclass
class Workload:
    """Token-id segments of each conversation: ``segments[c][0]`` turn 1's prompt,
    ``segments[c][t]`` the user text appended at turn t + 1."""

    segments: list[list[list[int]]]
    max_tokens: int

    @property
    def turns(self) -> int:
        return len(self.segments[0])


def make_workload(
    tokenizer_dir,
    conversations: int,
    turns: int,
    first_tokens: int,
    user_tokens: int,
    max_tokens: int,
    seed: int = 0,
) -> Workload:
    """Distinct corpus windows (unseen documents of the tiny corpus): turn 1 starts at a
    document start, user texts are the following windows."""
    from serving_reliability import corpus_stream

    from vllm_nemotron_spec.tiny.tokenizer import BOS_ID

    per_conv = first_tokens + (turns - 1) * user_tokens
    stream = corpus_stream(tokenizer_dir, conversations * (per_conv + 512) + 4096, seed=2024 + seed)
    starts = [i for i, t in enumerate(stream) if t == BOS_ID]
    rng = random.Random(seed)
    segments, used_until = [], 0
    for _ in range(conversations):
        start = next(s for s in starts if s >= used_until + rng.randint(0, 64))
        if start + per_conv > len(stream):
            raise RuntimeError("corpus stream too short for the workload")
        pos = start + first_tokens
        conv = [stream[start:pos]]
        for _ in range(turns - 1):
            conv.append(stream[pos : pos + user_tokens])
            pos += user_tokens
        segments.append(conv)
        used_until = pos
    return Workload(segments, max_tokens)


def top2_gaps(choice: dict) -> list[float | None]:
    """Per output token, top-1 minus top-2 logprob of the answer's ``top_logprobs`` (None
    where fewer than two are given)."""
    gaps = []
    for entry in (choice.get("logprobs") or {}).get("top_logprobs") or []:
        values = sorted((entry or {}).values(), reverse=True)
        gaps.append(values[0] - values[1] if len(values) >= 2 else None)
    return gaps


def run_workload(
    server: serve.Server, workload: Workload, *, logprobs: bool, timeout: float
) -> dict:
    """All conversations at once, turn by turn; per turn the answers and the /metrics deltas."""
    model = _common.served_model(server.url)
    histories = [list(conv[0]) for conv in workload.segments]
    turns = []
    pool = ThreadPoolExecutor(max_workers=len(histories))
    try:
        for t in range(workload.turns):
            if t:
                for c, conv in enumerate(workload.segments):
                    histories[c] += conv[t]
            prompts = [list(h) for h in histories]
            before = _common.settled_snapshot(server.url, settle_s=1.0)
            t0 = time.perf_counter()

            def one(prompt):
                body = {
                    "model": model,
                    "prompt": prompt,
                    "max_tokens": workload.max_tokens,
                    "temperature": 0.0,
                    "ignore_eos": True,
                    "return_token_ids": True,
                }
                if logprobs:
                    body["logprobs"] = 2
                status, data = http.post_json(f"{server.url}/v1/completions", body, timeout)
                if status != 200 or not isinstance(data, dict):
                    raise http.CompletionError(f"HTTP {status}: {str(data)[:300]}")
                choice = data["choices"][0]
                return list(choice.get("token_ids") or []), (
                    top2_gaps(choice) if logprobs else None
                )

            answers = list(pool.map(one, prompts))
            seconds = time.perf_counter() - t0
            delta = _common.settled_snapshot(server.url).minus(before)
            for c, (ids, _) in enumerate(answers):
                histories[c] += ids
            turns.append(
                {
                    "turn": t + 1,
                    "prompt_lengths": [len(p) for p in prompts],
                    "seconds": round(seconds, 3),
                    "outputs": [ids for ids, _ in answers],
                    "top2_gaps": [g for _, g in answers] if logprobs else None,
                    **delta.to_json(),
                }
            )
    finally:
        pool.shutdown(wait=True)
    return {"turns": turns, "cache_config": _common.snapshot(server.url).cache_config}


def compare(run: dict, reference: dict) -> dict:
    """Token-for-token comparison with a reference run (plain decoding's, or vLLM alone's with the
    same draft), turn by turn; with the prefix-cache hits and, where the reference recorded them,
    its top-2 logprob gap at each first difference."""
    mismatches, hits_equal = [], []
    for t, (turn, ref) in enumerate(zip(run["turns"], reference["turns"])):
        for c, (ids, ref_ids) in enumerate(zip(turn["outputs"], ref["outputs"])):
            if ids == ref_ids:
                continue
            pos = next(
                (i for i, (a, b) in enumerate(zip(ids, ref_ids)) if a != b),
                min(len(ids), len(ref_ids)),
            )
            gaps = (ref.get("top2_gaps") or [[]] * (c + 1))[c] or []
            mismatches.append(
                {
                    "turn": t + 1,
                    "conversation": c,
                    "position": pos,
                    "got": ids[pos : pos + 4],
                    "reference": ref_ids[pos : pos + 4],
                    "reference_top2_logprob_gap": gaps[pos] if pos < len(gaps) else None,
                }
            )
        hits_equal.append(
            turn["prefix_cache_hits"] == ref["prefix_cache_hits"]
            and turn["prefix_cache_queries"] == ref["prefix_cache_queries"]
        )
    complete = len(run["turns"]) == len(reference["turns"])
    return {
        "exact": complete and not mismatches,
        "mismatches": mismatches[:20],
        "num_mismatching_outputs": len(mismatches),
        "num_outputs": sum(len(t["outputs"]) for t in run["turns"]),
        "prefix_hits_equal": complete and all(hits_equal),
        "prefix_hits_equal_per_turn": hits_equal,
    }


# ------------------------------------------------------------------------------------------
# Servers


def server_args(args, cfg: Config) -> list[str]:
    if args.device == "cpu":
        base = list(serve.CPU_TINY_SERVE_ARGS)
    else:
        base = [
            "--dtype",
            args.dtype,
            "--gpu-memory-utilization",
            str(args.gpu_memory_utilization),
            "--seed",
            "0",
        ]
        if args.features.get("kv_cache_memory_bytes_flag"):
            base += ["--kv-cache-memory-bytes", str(int(args.kv_cache_gib * (1 << 30)))]
        if args.eager:
            base.append("--enforce-eager")
    return [
        *base,
        "--max-model-len",
        str(args.max_model_len),
        "--max-num-seqs",
        str(max(4, args.conversations)),
        *FLAG_SETS[cfg.flags],
    ]


def speculative_config(args, cfg: Config, drafts: dict, flashinfer_draft: bool) -> dict | None:
    if cfg.method is None:
        return None
    spec = {
        "method": cfg.method,
        "model": str(drafts[cfg.method]),
        "num_speculative_tokens": NUM_SPECULATIVE_TOKENS,
    }
    if cfg.method == "dflash" and flashinfer_draft:
        spec["attention_backend"] = "FLASHINFER"
    return spec


def wants_flashinfer_draft(args, cfg: Config) -> bool:
    f = args.features
    return (
        cfg.method == "dflash"
        and args.device != "cpu"
        and args.dflash_attention != "default"
        and f["flashinfer_importable"]
        and f["speculative_attention_backend_field"]
    )


def start_group(args, configs: list[Config], drafts: dict, target: str, out: Path) -> dict:
    """Launch the servers of ``configs`` together; wait for each; DFlash on FLASHINFER that
    fails to start is started again with vLLM's default draft backend. Returns name -> entry
    (``server`` set when it runs)."""
    entries = {}
    for cfg in configs:
        fi = wants_flashinfer_draft(args, cfg)
        entries[cfg.name] = {"config": cfg, "flashinfer_draft": fi, "attempts": []}
    for attempt in range(2):
        launched = []
        for name, e in entries.items():
            if e.get("server") or (attempt and not e.pop("retry", False)):
                continue
            cfg = e["config"]
            spec = speculative_config(args, cfg, drafts, e["flashinfer_draft"])
            log = out / "logs" / f"{name}{'-retry' if attempt else ''}.log"
            srv = _common.launch(
                target,
                log,
                args=server_args(args, cfg),
                speculative_config=spec,
                plugin=cfg.plugin,
                launcher=args.launcher,
            )
            e.update(speculative_config=spec, args=server_args(args, cfg), log=str(log))
            launched.append((name, srv))
        for name, srv in launched:
            e = entries[name]
            try:
                serve.wait_ready(srv, timeout=args.start_timeout)
                e["server"] = srv
                e["startup_s"] = round(srv.started_s, 1)
                e["attempts"].append(
                    {
                        "draft_attention": "FLASHINFER" if e["flashinfer_draft"] else "default",
                        "status": "started",
                        "startup_s": e["startup_s"],
                    }
                )
            except serve.ServerStartError as exc:
                e["attempts"].append(
                    {
                        "draft_attention": "FLASHINFER" if e["flashinfer_draft"] else "default",
                        "status": "failed",
                        "error": _common.start_error(exc),
                        "log_tail": exc.log[-2500:],
                    }
                )
                if e["flashinfer_draft"] and args.dflash_attention == "auto":
                    e["flashinfer_draft"], e["retry"] = False, True
        if not any(e.get("retry") for e in entries.values()):
            break
    return entries


# ------------------------------------------------------------------------------------------
# Report


COLUMNS = [
    "config",
    "status",
    "draft attention",
    "startup s",
    "exact vs plain",
    "mismatches (first)",
    "prefix hits / queries per turn",
    "hits = plain",
    "= vLLM alone (outputs, hits)",
    "acceptance per turn",
    "engine cache",
]


def markdown(result: dict) -> str:
    rows = []
    for r in result["configs"]:
        turns = r.get("turns") or []
        hits = " ; ".join(f"{t['prefix_cache_hits']}/{t['prefix_cache_queries']}" for t in turns)
        acc = " ; ".join(
            "-" if t.get("mean_acceptance_length") is None else f"{t['mean_acceptance_length']:.2f}"
            for t in turns
        )
        cmp_ = r.get("comparison") or {}
        first = (cmp_.get("mismatches") or [None])[0]
        first_s = (
            ""
            if not first
            else (
                f"{cmp_['num_mismatching_outputs']} (turn {first['turn']} conv "
                f"{first['conversation']} pos {first['position']}, gap "
                f"{first['reference_top2_logprob_gap']})"
            )
        )
        cc = r.get("cache_config") or {}
        cache_s = ", ".join(
            f"{k} {cc[k]}"
            for k in ("block_size", "enable_prefix_caching", "mamba_cache_mode", "cache_dtype")
            if k in cc
        )
        status = (
            r["status"]
            if r["status"] == "ok"
            else f"{r['status']}: {str(r.get('error', ''))[:160]}"
        )
        rows.append(
            f"| {r['name']} | {status.replace('|', '/')} | {r.get('draft_attention') or ''} | "
            f"{r.get('startup_s', '')} | {cmp_.get('exact', '') if r['variant'] != 'plain' else 'reference'} | "
            f"{first_s} | {hits} | {cmp_.get('prefix_hits_equal', '') if r['variant'] != 'plain' else ''} "
            f"| {_as_vllm_alone(r.get('vs_vllm_alone'))} | {acc} | {cache_s} |"
        )
    title = "Recipe check: exactness and prefix-cache hits through `vllm serve`"
    return _common.results_markdown(
        title, result["setup"], COLUMNS, rows, f"**{result['verdict']}**"
    )


def _as_vllm_alone(c: dict | None) -> str:
    if not c:
        return ""
    equal = c["num_outputs"] - c["num_mismatching_outputs"]
    return f"{equal}/{c['num_outputs']}, {'equal' if c['prefix_hits_equal'] else 'differ'}"


def _same_as(c: dict | None) -> bool:
    return bool(c) and c["exact"] and c["prefix_hits_equal"]


def _differences(c: dict, reference: str) -> str:
    """How a row differs from ``reference`` (plain or vLLM alone): its outputs (with the
    reference's top-2 gap at the first difference, where recorded) and/or its prefix hits, only
    the clauses that apply."""
    parts = []
    if c["num_mismatching_outputs"]:
        gap = (c.get("mismatches") or [{}])[0].get("reference_top2_logprob_gap")
        parts.append(
            f"{c['num_mismatching_outputs']} outputs differ from {reference}"
            + ("" if gap is None else f", first at top-2 gap {gap}")
        )
    if not c["prefix_hits_equal"]:
        parts.append(f"prefix hits differ from {reference}")
    return ", ".join(parts)


def verdict(result: dict) -> tuple[str, bool]:
    """PASS when every plugin configuration ran and each either equals plain decoding served with
    the same flags (outputs and prefix hits), or, where vLLM alone ran the same draft with the same
    flags, equals vLLM alone's outputs and hits token for token. The second is the bar on GPU in
    bf16, where speculative and plain decoding take other kernel shapes and part at near-ties with
    or without the plugin; exactness against plain is asserted on CPU in fp32 (the test suite)."""
    judged = [r for r in result["configs"] if r["plugin"] and r["variant"] != "plain"]
    bad, notes, as_vllm_alone = [], [], []
    for r in result["configs"]:
        if r["status"] != "ok":
            (bad if r["plugin"] and r["status"] != "refused" else notes).append(
                f"{r['name']} {r['status']}"
            )
    for r in judged:
        c, twin = r.get("comparison"), r.get("vs_vllm_alone")
        if r["status"] != "ok" or _same_as(c):
            continue
        if c is None:
            bad.append(f"{r['name']} has no plain reference")
        elif _same_as(twin):
            as_vllm_alone.append(f"{r['name']} ({_differences(c, 'plain')})")
        elif twin:
            bad.append(f"{r['name']} ({_differences(twin, 'vLLM alone')})")
        else:
            exact = "" if c["exact"] else " NOT EXACT"
            bad.append(f"{r['name']}{exact} ({_differences(c, 'plain')})")
    for r in result["configs"]:
        c = r.get("comparison")
        if not r["plugin"] and c:
            notes.append(f"{r['name']}: exact={c['exact']} hits=plain:{c['prefix_hits_equal']}")
    off = [
        r["name"]
        for r in result["configs"]
        if "--enable-prefix-caching" in FLAG_SETS.get(r.get("flags"), ())
        and (r.get("cache_config") or {}).get("enable_prefix_caching") == "False"
    ]
    if off:  # hits then compare 0 with 0: say so
        notes.append(f"prefix caching asked for but OFF in the engine for {', '.join(off)}")
    exact = sum(1 for r in judged if r["status"] == "ok" and _same_as(r.get("comparison")))
    ok = not bad and exact + len(as_vllm_alone) > 0
    text = (
        f"RECIPE CHECK: {'PASS' if ok else 'FAIL'} - {exact}/{len(judged)} plugin configurations exact "
        f"with plain's prefix hits"
        + (
            f", {len(as_vllm_alone)} token for token as vLLM alone: {'; '.join(as_vllm_alone)}"
            if as_vllm_alone
            else ""
        )
        + (f"; problems: {'; '.join(bad)}" if bad else "")
        + (f"; notes: {'; '.join(notes)}" if notes else "")
    )
    return text, ok


# ------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", required=True)
    p.add_argument(
        "--family",
        default=None,
        help="cache directory holding tiny-family-seed0/ and tiny-drafts-trained-seed0/ "
        "(default $VLLM_NEMOTRON_SPEC_CACHE, else .cache/nemotron-spec); built there if absent "
        "(~2-4 minutes of CPU)",
    )
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument(
        "--shape",
        choices=("tiny", "flashinfer"),
        default="tiny",
        help="the tiny family (default) or its FlashInfer-shaped twin; see above",
    )
    p.add_argument(
        "--configs",
        default=None,
        help=f"comma list of VARIANT@FLAGS (default CUDA: {DEFAULT_GPU}; CPU: {DEFAULT_CPU})",
    )
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--first-tokens", type=int, default=600)
    p.add_argument("--user-tokens", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--dtype", default="bfloat16", help="CUDA only (CPU: float32)")
    p.add_argument(
        "--eager",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--enforce-eager on the servers (default on: faster start, same tokens)",
    )
    p.add_argument(
        "--dflash-attention",
        choices=("auto", "flashinfer", "default"),
        default="auto",
        help="DFlash draft attention: auto = FLASHINFER when importable, vLLM's default if that fails",
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.05)
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--launcher", choices=("auto", "vllm", "passthrough"), default="auto")
    p.add_argument("--start-timeout", type=float, default=420.0)
    p.add_argument("--request-timeout", type=float, default=180.0)
    p.add_argument("--budget-s", type=float, default=540.0, help="start no flag set after this")
    args = p.parse_args(argv)

    t_start = time.time()
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    os.environ["VLLM_NEMOTRON_SPEC_CACHE"] = str(
        Path(
            args.family
            or os.environ.get("VLLM_NEMOTRON_SPEC_CACHE")
            or _common.REPO / ".cache" / "nemotron-spec"
        ).resolve()
    )
    args.features = _common.detect_features()
    if args.device == "auto":
        args.device = args.features["device"]
    default = (
        DEFAULT_CPU
        if args.device == "cpu"
        else DEFAULT_FLASHINFER_SHAPE
        if args.shape == "flashinfer"
        else DEFAULT_GPU
    )
    configs = parse_configs(args.configs or default)
    skipped = []
    if any(c.flags == "recipe" for c in configs) and not (
        args.features["mamba_backend_flag"] and args.features["flashinfer_importable"]
    ):
        skipped = [c for c in configs if c.flags == "recipe"]
        configs = [c for c in configs if c.flags != "recipe"]

    from vllm_nemotron_spec.tiny.build import build_tiny_family, ensure_tiny_family
    from vllm_nemotron_spec.tiny.train_draft import ensure_trained_drafts

    t0 = time.time()
    if args.shape == "flashinfer":  # its own directory: the two families' drafts must not mix
        root = Path(os.environ["VLLM_NEMOTRON_SPEC_CACHE"]) / "flashinfer" / "tiny-family-seed0"
        family = build_tiny_family(root, seed=0, spec=flashinfer_shaped_spec())
    else:
        family = ensure_tiny_family(seed=0)
    trained = ensure_trained_drafts(family=family)
    family_s = round(time.time() - t0, 1)
    drafts = {"dflash": trained.dflash, "dspark": trained.dspark}
    workload = make_workload(
        family.tokenizer,
        args.conversations,
        args.turns,
        args.first_tokens,
        args.user_tokens,
        args.max_tokens,
    )
    result = {
        "setup": {
            "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
            "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
            "device": args.device,
            **_common.versions(),
            "features": args.features,
            "plugin_entry_point_installed": _common.plugin_installed(),
            "family": str(family.root),
            "shape": args.shape,
            "family_ready_s": family_s,
            "num_speculative_tokens": NUM_SPECULATIVE_TOKENS,
            "workload": f"{args.conversations} conversations at once x {args.turns} turns, first prompt "
            f"{args.first_tokens} tokens, +{args.user_tokens} user tokens a turn, "
            f"{args.max_tokens} output tokens, greedy, ignore_eos",
            "eager": args.eager,
            "dtype": "float32" if args.device == "cpu" else args.dtype,
            "flag_sets": {k: " ".join(v) for k, v in FLAG_SETS.items()},
        },
        "configs": [],
    }
    for cfg in skipped:
        result["configs"].append(
            {
                "name": cfg.name,
                "variant": cfg.variant,
                "flags": cfg.flags,
                "plugin": cfg.plugin,
                "status": "skipped",
                "error": "vLLM has no --mamba-backend flag or FlashInfer does not import here",
            }
        )

    def save():
        result["verdict"], _ = verdict(result)
        _common.write_results(out, "recipe_check", result, markdown(result))

    groups: dict[str, list[Config]] = {}
    for cfg in configs:
        groups.setdefault(cfg.flags, []).append(cfg)
    longest = 0.0
    for flags, group in groups.items():
        remaining = args.budget_s - (time.time() - t_start)
        if remaining < max(60.0, longest):
            for cfg in group:
                result["configs"].append(
                    {
                        "name": cfg.name,
                        "variant": cfg.variant,
                        "flags": flags,
                        "plugin": cfg.plugin,
                        "status": "skipped",
                        "error": "time budget",
                    }
                )
            save()
            continue
        g0 = time.time()
        if not any(c.variant == "plain" for c in group):
            group = [Config("plain", flags), *group]
        print(
            f"[{time.time() - t_start:5.0f}s] @{flags}: starting {[c.variant for c in group]}",
            flush=True,
        )
        entries = start_group(args, group, drafts, str(family.target), out)
        runs: dict[str, dict] = {}
        try:

            def work(name, entries=entries):
                e = entries[name]
                try:
                    return (
                        name,
                        run_workload(
                            e["server"],
                            workload,
                            logprobs=e["config"].variant == "plain",
                            timeout=args.request_timeout,
                        ),
                        None,
                    )
                except Exception as exc:  # noqa: BLE001 - recorded
                    return (
                        name,
                        None,
                        f"{type(exc).__name__}: {exc}"[:1500]
                        + "\n"
                        + traceback.format_exc()[-1500:],
                    )

            ready = [n for n, e in entries.items() if e.get("server")]
            with ThreadPoolExecutor(max_workers=max(1, len(ready))) as pool:
                for name, run, err in pool.map(work, ready):
                    runs[name] = run if run is not None else {"error": err}
        finally:
            for e in entries.values():
                if e.get("server"):
                    e["server"].stop()
        plain = runs.get(f"plain@{flags}")
        for name, e in entries.items():
            cfg = e["config"]
            run = runs.get(name) or {}
            log = Path(e["log"]).read_text(errors="replace") if Path(e["log"]).is_file() else ""
            entry = {
                "name": name,
                "variant": cfg.variant,
                "flags": flags,
                "plugin": cfg.plugin,
                "server_args": e.get("args"),
                "speculative_config": e.get("speculative_config"),
                "startup_s": e.get("startup_s"),
                "attempts": e["attempts"],
                "draft_attention": (
                    None
                    if cfg.method != "dflash"
                    else "FLASHINFER"
                    if e["flashinfer_draft"]
                    else "vLLM default"
                ),
                "backend_log_lines": _common.backend_lines(log),
            }
            if not e.get("server"):
                err = e["attempts"][-1].get("error") if e["attempts"] else "not started"
                entry.update(status="refused" if err and REFUSAL.match(err) else "error", error=err)
            elif "error" in run:
                entry.update(status="error", error=run["error"])
            else:
                entry.update(status="ok", turns=run["turns"], cache_config=run["cache_config"])
                if cfg.variant != "plain" and plain and "turns" in plain:
                    entry["comparison"] = compare(run, plain)
                twin = runs.get(f"{cfg.variant}-upstream@{flags}") if cfg.plugin else None
                if twin and "turns" in twin:  # the same draft and flags with vLLM alone
                    entry["vs_vllm_alone"] = compare(run, twin)
            result["configs"].append(entry)
            c = entry.get("comparison") or {}
            print(
                f"[{time.time() - t_start:5.0f}s]   {name}: {entry['status']} "
                f"{'' if entry['status'] == 'ok' else str(entry.get('error'))[:200]}"
                f"{'exact=' + str(c.get('exact')) + ' hits=plain:' + str(c.get('prefix_hits_equal')) if c else ''} "
                f"hits/queries {[(t['prefix_cache_hits'], t['prefix_cache_queries']) for t in entry.get('turns', [])]}",
                flush=True,
            )
        longest = max(longest, time.time() - g0)
        save()
    result["wall_s"] = round(time.time() - t_start, 1)
    save()
    text, ok = verdict(result)
    print(text, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
