"""GPU check of the Nemotron 3.5 DFlash and DSpark paths on vLLM 0.33 (CUDA).

Runs the tiny family's NemotronH target with plain decoding and with the drafts trained against
it (`vllm_nemotron_spec.tiny.train_draft.ensure_trained_drafts`): DFlash (official layout and the
shifted-layout control) and DSpark (bonus-anchor layout as trained, and the same weights with
`sample_from_anchor: true`, the wrong-anchor control), and the trained DFlash draft quantized by
the compressed-tensors library (llm-compressor's NVFP4A16 format; vLLM's own compressed-tensors
scheme and kernels on GPU). Records per run: greedy lossless
(token-identical to plain decoding), mean acceptance length, per-position acceptance, tokens/s.
`--runner v2` (vLLM's default on CUDA: DFlashSpeculator / DSparkSpeculator running the plugin's
draft classes) or `--runner v1` (vLLM's V1 runner with the plugin's proposers, as on CPU).
Nothing is downloaded; the tiny family is read from $VLLM_NEMOTRON_SPEC_CACHE (carry
`.cache/nemotron-spec` to the GPU machine).

    python benchmarks/gpu_spec_check.py --out /tmp/spec-gpu --runner v2   # ~2-4 minutes on an H200
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def ensure_ct_dflash(bf16_draft: Path, seed: int = 0) -> Path:
    """The trained BF16 DFlash draft quantized NVFP4A16 by the compressed-tensors library
    (``nvfp4-pack-quantized``, as llm-compressor writes it; tests/quantize/ct_draft.py), cached
    next to the trained drafts."""
    import hashlib
    import shutil

    from vllm_nemotron_spec.tiny.build import default_cache_dir

    source = hashlib.sha256(
        b"".join(f.read_bytes() for f in sorted(Path(bf16_draft).glob("*.safetensors")))
    )
    out = default_cache_dir() / f"ct-dflash-nvfp4a16-seed{seed}-{source.hexdigest()[:12]}"
    if (out / "config.json").is_file():
        return out
    import torch

    from tests.quantize.ct_draft import build_ct_draft

    shutil.rmtree(out, ignore_errors=True)
    with torch.compiler.set_stance("force_eager"):  # its FP4 rounding needs no inductor here
        return build_ct_draft(bf16_draft, out)


def drafts_to_check(seed: int = 0) -> dict[str, tuple[str, Path | Callable[[], Path], int]]:
    """name -> (method, draft, num_speculative_tokens), from the cache of trained drafts; a draft
    built on first use (the compressed-tensors copy, ~1 minute) is a function, called only when
    that run is selected."""
    from vllm_nemotron_spec.tiny.train_draft import ensure_trained_drafts

    trained = ensure_trained_drafts(seed)
    return {
        "dflash-trained": ("dflash", trained.dflash, 4),
        "dflash-shifted-layout": ("dflash", trained.dflash_shifted, 4),
        "dflash-compressed-tensors": (
            "dflash",
            lambda: ensure_ct_dflash(trained.dflash_unquantized, seed),
            4,
        ),
        "dspark-trained": ("dspark", trained.dspark, 3),
        "dspark-wrong-anchor": ("dspark", trained.dspark_wrong_anchor, 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--runner", choices=("v1", "v2"), default="v2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--only", default=None, help="comma-separated subset of the draft names")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_NEMOTRON_SPEC_CACHE", str(REPO / ".cache" / "nemotron-spec"))
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if args.runner == "v2" else "0"

    import torch
    import vllm

    from vllm_nemotron_spec.runs import generate, make_llm, release
    from vllm_nemotron_spec.tiny.build import ensure_tiny_family
    from vllm_nemotron_spec.tiny.corpus import sample_prompts

    family = ensure_tiny_family(seed=0)
    drafts = drafts_to_check()
    only = set(args.only.split(",")) if args.only else None
    if only and only - set(drafts):
        parser.error(f"--only: unknown {sorted(only - set(drafts))}; choose from {list(drafts)}")
    prompts = (sample_prompts() * args.num_prompts)[: args.num_prompts]
    # one long prompt (past several KV blocks)
    prompts[-1] = " ".join(sample_prompts()) * 2
    common = dict(dtype=args.dtype, gpu_memory_utilization=0.25, max_model_len=1024)
    out = {
        "vllm_version": vllm.__version__,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "dtype": args.dtype,
        "runner": args.runner,
        "runs": [],
    }

    llm = make_llm(str(family.target), None, **common)
    plain = generate(llm, prompts, args.max_tokens, "plain")
    release(llm)
    out["runs"].append({"method": "plain", "tokens_per_s": plain.tokens_per_s})
    for name, (method, draft, k) in drafts.items():
        if only and name not in only:
            continue
        draft = draft() if callable(draft) else draft
        spec = {"method": method, "model": str(draft), "num_speculative_tokens": k}
        t0 = time.time()
        try:
            llm = make_llm(str(family.target), spec, **common)
            startup = time.time() - t0
            result = generate(llm, prompts, args.max_tokens, name)
            release(llm)
        except Exception as exc:  # record and go on: one broken run must not hide the others
            out["runs"].append({"method": name, "error": f"{type(exc).__name__}: {exc}"[:2000]})
            continue
        mismatches = [
            i for i, (a, b) in enumerate(zip(result.token_ids, plain.token_ids)) if a != b
        ]
        out["runs"].append(
            {
                "method": name,
                "draft": str(draft),
                "num_speculative_tokens": k,
                "startup_s": round(startup, 1),
                "lossless": not mismatches,
                "mismatching_prompts": mismatches,
                "mean_acceptance_length": result.counters.mean_acceptance_length,
                "per_position_acceptance": result.counters.per_position_acceptance,
                "tokens_per_s": result.tokens_per_s,
            }
        )
        print(json.dumps(out["runs"][-1]), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"spec_gpu_{args.runner}.json").write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))
    return 0 if all(r.get("lossless", True) and "error" not in r for r in out["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
