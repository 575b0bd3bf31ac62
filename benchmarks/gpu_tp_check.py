"""Tensor-parallel check of the Nemotron 3.5 DFlash and DSpark paths on GPUs (vLLM 0.33, CUDA).

Runs the tiny family's NemotronH target plain and with the trained NVFP4 DFlash and DSpark drafts
(`ensure_trained_drafts`), at tensor_parallel_size 1 and `--tp N`, and records per run:

- lossless: greedy tokens equal to plain decoding AT THE SAME TP size (bf16 TP changes the order of
  the all-reduce's sums, so TP=N plain may differ from TP=1 plain; that agreement is reported
  separately as `plain_matches_tp1`);
- mean and per-position acceptance, and its difference from the TP=1 run of the same draft (the CPU
  tests find them equal in fp32; bf16 may move them slightly);
- for DSpark, which Markov walk each rank ran: the plugin's fused kernel or vLLM's loop with the
  reason (`models/nemotron35_dspark.py` logs and records it once per process);
- tokens/s.

Exit status 1 when a run fails or is not lossless. Nothing is downloaded; the tiny family is read
from $VLLM_NEMOTRON_SPEC_CACHE (carry `.cache/nemotron-spec` to the GPU machine).

    python benchmarks/gpu_tp_check.py --tp 2 --out /tmp/tp-gpu    # 2 GPUs; a few minutes
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _walk_choices(worker):
    """Runs in each worker: the DSpark Markov walk choices this process made (None = fused)."""
    from vllm.distributed import get_tensor_model_parallel_rank

    from vllm_nemotron_spec.models import nemotron35_dspark

    choices = sorted(nemotron35_dspark._WALK_CHOICES_LOGGED, key=str)
    return {
        "rank": get_tensor_model_parallel_rank(),
        "walk": ["fused" if c is None else f"vLLM loop: {c}" for c in choices],
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--runner", choices=("v1", "v2"), default="v2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_NEMOTRON_SPEC_CACHE", str(REPO / ".cache" / "nemotron-spec"))
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if args.runner == "v2" else "0"

    import torch
    import vllm

    from vllm_nemotron_spec.runs import generate, make_llm, release
    from vllm_nemotron_spec.tiny.build import ensure_tiny_family
    from vllm_nemotron_spec.tiny.corpus import sample_prompts
    from vllm_nemotron_spec.tiny.train_draft import ensure_trained_drafts

    family = ensure_tiny_family(seed=0)
    trained = ensure_trained_drafts(seed=0, family=family)
    drafts = {"plain": None, "dflash": (trained.dflash, 4), "dspark": (trained.dspark, 3)}
    prompts = (sample_prompts() * args.num_prompts)[: args.num_prompts]
    prompts[-1] = " ".join(sample_prompts()) * 2  # one long prompt (past several KV blocks)
    out = {
        "vllm_version": vllm.__version__,
        "torch": torch.__version__,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "dtype": args.dtype,
        "runner": args.runner,
        "tp": args.tp,
        "runs": [],
    }
    results, ok = {}, True
    for tp in dict.fromkeys((1, args.tp)):
        for method, draft in drafts.items():
            spec = (
                None
                if draft is None
                else {"method": method, "model": str(draft[0]), "num_speculative_tokens": draft[1]}
            )
            row = {"tp": tp, "method": method}
            try:
                llm = make_llm(
                    str(family.target),
                    spec,
                    dtype=args.dtype,
                    max_model_len=1024,
                    gpu_memory_utilization=0.25,
                    tensor_parallel_size=tp,
                )
                try:
                    result = generate(llm, prompts, args.max_tokens, method)
                    if method == "dspark":
                        row["markov_walk"] = llm.collective_rpc(_walk_choices)
                finally:
                    release(llm)
            except Exception as exc:  # noqa: BLE001 - record and go on: one broken run must not hide the others
                row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
                ok = False
                out["runs"].append(row)
                print(json.dumps(row), flush=True)
                continue
            results[tp, method] = result
            plain = results.get((tp, "plain"))
            row["tokens_per_s"] = result.tokens_per_s
            if method == "plain":
                if tp != 1 and (1, "plain") in results:
                    row["plain_matches_tp1"] = result.token_ids == results[1, "plain"].token_ids
            else:
                c = result.counters
                row["lossless"] = plain is not None and result.token_ids == plain.token_ids
                ok = ok and row["lossless"]
                row["mean_acceptance_length"] = c.mean_acceptance_length
                row["per_position_acceptance"] = c.per_position_acceptance
                base = results.get((1, method))
                if tp != 1 and base is not None and c.mean_acceptance_length is not None:
                    row["acceptance_minus_tp1"] = (
                        c.mean_acceptance_length - base.counters.mean_acceptance_length
                    )
            out["runs"].append(row)
            print(json.dumps(row), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / f"tp_gpu_{args.runner}_tp{args.tp}.json"
    path.write_text(json.dumps(out, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
