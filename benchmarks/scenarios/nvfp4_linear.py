"""nvfp4-linear: the NVFP4 W4A16 linear kernels at the draft shapes, error and time.

Cases (``harness/nvfp4_layers.py``), each a real vLLM layer built with the plugin's quantization
config and loaded through its weight loaders: ``fc`` 16128 -> 2688; ``gate_up`` 2688 -> 2 x 6144
with one global scale; ``gate_up_4x`` up's global scale 4 x gate's (folded into gate's block
scales: one GEMM); ``gate_up_3x`` ratio 3 (one GEMM per shard); ``down`` 6144 -> 2688;
``markov_w2`` (DSpark's Markov head) 512 -> 131072; at M = 1, 4, 16, 64 tokens.

GPU (the W4A16 kernel vLLM picks: Humming on Hopper with humming-kernels installed, else FP4
Marlin; ``VLLM_DISABLED_KERNELS=HummingNvFp4LinearKernel`` for Marlin): the relative max error
against ``x @ W_ref^T`` in float64 beside the BF16 baseline's and the kernel's tolerance (fp32-sum
kernels: 2 x the BF16 error + 2^-9; Humming, which adds split-K partial sums in BF16: 2^-6), the
fused cases' path, and us per call (a CUDA graph of calls) beside the unquantized BF16 layer.
For ``gate_up_4x`` / ``gate_up_3x`` also vLLM's own modelopt_fp4 method's error (one max global
scale for both shards). CPU (``--smoke``): outputs equal ``x @ W_ref^T`` bit for bit, and time
against dequantizing on the fly. ``--tp 2,4``: each rank's shard, one rank at a time with the
rank faked, against its part (no second GPU needed). Exit 1 on any failure.
"""

from __future__ import annotations

import argparse

from benchmarks.harness import report
from benchmarks.harness.common import Run, add_common_arguments

NAME = "nvfp4-linear"
TITLE = "nvfp4-linear: NVFP4 W4A16 linear layers at the draft shapes"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common_arguments(p, models=False)
    p.add_argument("--m", default=None, help="token counts (default 1,4,16,64; smoke 1,4)")
    p.add_argument("--cases", default=None, help="comma-separated (default all; smoke two)")
    p.add_argument("--reps", type=int, default=5, help="CPU: timed calls per measurement")
    p.add_argument("--tp", default=None,
                   help="check the tensor-parallel shards at these sizes (e.g. 2,4), one rank at "
                   "a time, instead of timing")  # fmt: skip


def run(args) -> int:
    import torch

    from benchmarks.harness import nvfp4_layers as nl

    run_ = Run(NAME, args)
    device = "cuda" if run_.device == "cuda" and torch.cuda.is_available() else "cpu"
    ms = [int(v) for v in (args.m or ("1,4" if args.smoke else "1,4,16,64")).split(",")]
    cases = (args.cases or ("gate_up_3x,down" if args.smoke else ",".join(nl.CASES))).split(",")
    unknown = sorted(set(cases) - set(nl.CASES))
    if unknown:
        raise SystemExit(f"--cases: unknown {unknown}; choose from {list(nl.CASES)}")
    tps = [int(v) for v in args.tp.split(",")] if args.tp else []
    rows, failures = measure(nl, device, cases, ms, tps, args.reps, run_)
    result = {"scenario": NAME, "device": device, "facts": nl.device_facts(device), "ok": not failures,
              "failures": failures, "rows": rows, "setup": run_.setup}  # fmt: skip
    run_.finish(TITLE, result, tables(result))
    return 0 if not failures else 1


def measure(nl, device: str, cases, ms, tps, reps: int, run_) -> tuple[list, list]:
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config

    from vllm_nemotron_spec.nvfp4 import config as nvcfg

    if device == "cuda":
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = False  # a clean fp32/fp64 reference
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    rows: list[dict] = []
    failures: list[str] = []
    with set_current_vllm_config(VllmConfig()):
        nl.init_vllm(device)
        nvcfg.register()
        qc = nvcfg.NemotronW4A16NvFp4Config.from_config(nl.QUANT_CONFIG)
        dev = torch.device(device)
        for case in cases:
            if tps and nl.CASES[case][0] not in nl.TP_KINDS:
                run_.say(f"{case}: a {nl.CASES[case][0]} layer, not split under tensor parallelism")
                continue
            run_.say(f"{case}: quantizing and loading")
            shards = nl.make_shards(case, dev)
            with torch.device(dev):
                if tps:
                    for tp in tps:
                        nl.run_case_tp(case, shards, qc, ms, tp, dev, rows, failures)
                elif device == "cuda":
                    nl.run_case_gpu(case, shards, qc, ms, rows, failures)
                else:
                    nl.run_case_cpu(case, shards, qc, ms, reps, rows, failures)
            del shards
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows, failures


def _e(value) -> str:
    return report.fmt(value, "{:.2e}")


def tables(result: dict) -> list:
    rows, failures = result["rows"], result["failures"]
    verdict = ["**PASS**" if not failures else "**FAIL**"] + [f"- FAIL: {f}" for f in failures]
    if rows and "tp" in rows[0]:
        t = report.Table("Tensor-parallel shards", ["case", "TP", "rank", "split", "M",
                         "rank's part", "path", "rel max err", "bf16 baseline err", "tolerance",
                         "max abs diff vs TP=1 slice"], notes=verdict)  # fmt: skip
        for r in rows:
            part = f"{r['rows']} x {r['cols']}" if "rows" in r else "sum of the ranks"
            t.add(r["case"], r["tp"], r["rank"], r["split"], r["m"], part, r.get("path"),
                  _e(r["rel_max_err"]), _e(r.get("rel_max_err_bf16")), _e(r.get("tolerance")),
                  _e(r.get("max_abs_diff_vs_tp1_slice")))  # fmt: skip
        return [t]
    if result["device"] == "cuda":
        t = report.Table("GPU kernels", ["case", "M", "kernel", "path", "rel max err",
                         "bf16 baseline err", "tolerance", "vLLM modelopt_fp4 err", "us NVFP4",
                         "us bf16", "speed-up"], notes=verdict)  # fmt: skip
        for r in rows:
            t.add(r["case"], r["m"], r["kernel"], r["path"], _e(r["rel_max_err"]),
                  _e(r["rel_max_err_bf16"]), _e(r["tolerance"]), _e(r.get("rel_max_err_vllm_modelopt_fp4")),
                  f"{r['us_nvfp4']:.1f}", f"{r['us_bf16']:.1f}", f"{r['us_bf16'] / r['us_nvfp4']:.2f}x")  # fmt: skip
        return [t]
    t = report.Table("CPU (the plugin's dequantize-at-load method)", ["case", "dtype", "M", "exact",
                     "us dequantized at load", "us on the fly", "us vLLM dense (oneDNN)",
                     "MB at load", "MB on the fly"], notes=verdict)  # fmt: skip
    for r in rows:
        t.add(r["case"], r["dtype"], r["m"], r["exact"], f"{r['us_at_load']:.0f}",
              f"{r['us_on_the_fly']:.0f}", f"{r['us_vllm_dense']:.0f}",
              f"{r['bytes_at_load'] / 2**20:.1f}", f"{r['bytes_on_the_fly'] / 2**20:.1f}")  # fmt: skip
    return [t]
