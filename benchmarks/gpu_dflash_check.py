"""GPU check of the Nemotron 3.5 DFlash path on vLLM 0.33 (CUDA, model runner V2).

Runs the tiny family's NemotronH target with plain decoding and with the DFlash drafts trained
against it (`vllm_nemotron_spec.tiny.train_draft.ensure_trained_drafts`; the official layout and
the shifted-layout control),
and records: greedy lossless (token-identical to plain decoding), mean acceptance length,
per-position acceptance, which draft class vLLM built. Nothing is downloaded; the tiny family is
read from $VLLM_NEMOTRON_SPEC_CACHE (carry `.cache/nemotron-spec` to the GPU machine).

    python benchmarks/gpu_dflash_check.py --out /tmp/dflash-gpu     # ~2-4 minutes on an H200
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def drafts_to_check(seed: int = 0) -> dict[str, Path]:
    """The trained DFlash drafts (official layout, and the shifted-layout control), from the cache."""
    from vllm_nemotron_spec.tiny.train_draft import ensure_trained_drafts

    trained = ensure_trained_drafts(seed)
    return {"dflash-trained": trained.dflash, "dflash-shifted-layout": trained.dflash_shifted}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_NEMOTRON_SPEC_CACHE", str(REPO / ".cache" / "nemotron-spec"))

    import torch
    import vllm

    from vllm_nemotron_spec.runs import generate, make_llm, release
    from vllm_nemotron_spec.tiny.build import ensure_tiny_family
    from vllm_nemotron_spec.tiny.corpus import sample_prompts

    family = ensure_tiny_family(seed=0)
    prompts = (sample_prompts() * args.num_prompts)[: args.num_prompts]
    # one long prompt (past several KV blocks)
    prompts[-1] = " ".join(sample_prompts()) * 2
    common = dict(dtype=args.dtype, gpu_memory_utilization=0.25, max_model_len=1024)
    out = {"vllm_version": vllm.__version__, "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name(0), "dtype": args.dtype, "runs": []}

    llm = make_llm(str(family.target), None, **common)
    plain = generate(llm, prompts, args.max_tokens, "plain")
    release(llm)
    out["runs"].append({"method": "plain", "tokens_per_s": plain.tokens_per_s})
    for name, draft in drafts_to_check().items():
        spec = {"method": "dflash", "model": str(draft),
                "num_speculative_tokens": args.num_speculative_tokens}
        t0 = time.time()
        try:
            llm = make_llm(str(family.target), spec, **common)
        except Exception as exc:  # record and go on: one broken draft must not hide the others
            out["runs"].append({"method": name, "error": f"{type(exc).__name__}: {exc}"[:2000]})
            continue
        startup = time.time() - t0
        result = generate(llm, prompts, args.max_tokens, name)
        release(llm)
        mismatches = [i for i, (a, b) in enumerate(zip(result.token_ids, plain.token_ids)) if a != b]
        out["runs"].append({
            "method": name, "draft": str(draft), "startup_s": round(startup, 1),
            "lossless": not mismatches, "mismatching_prompts": mismatches,
            "mean_acceptance_length": result.counters.mean_acceptance_length,
            "per_position_acceptance": result.counters.per_position_acceptance,
            "tokens_per_s": result.tokens_per_s,
        })
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "dflash_gpu.json").write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))
    return 0 if all(r.get("lossless", True) and "error" not in r for r in out["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
