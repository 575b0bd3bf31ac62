"""NVFP4 W4A16 linear layers at the real draft shapes, built the way vLLM builds them.

Each case is a real vLLM layer (``ReplicatedLinear``, ``MergedColumnParallelLinear``,
``RowParallelLinear``, ``ParallelLMHead``) made with the plugin's quantization config and loaded
through its weight loaders from ModelOpt-style tensors (``nvfp4.format.quantize`` of Gaussian
weights with a few outliers). GPU: error against the reference dequantization in float64 and time
per call (a CUDA graph of calls) beside the same layer unquantized in BF16; CPU: bit-exactness of
the plugin's dequantize-at-load method against ``x @ W_ref^T``, and its time against dequantizing
on the fly. Tensor parallelism: each rank's shard, one rank at a time with the rank faked (no
process group), against its part of the reference. Used by the ``nvfp4-linear`` scenario.
"""

from __future__ import annotations

import socket
import statistics
import time

import torch
import torch.nn.functional as F

from vllm_nemotron_spec.nvfp4 import format as nvfp4

CASES = {
    # name: (layer kind, input features, output features per shard, ratio of shard global scales)
    "fc": ("replicated", 16128, [2688], None),
    "gate_up": ("merged", 2688, [6144, 6144], 1.0),
    "gate_up_4x": ("merged", 2688, [6144, 6144], 4.0),
    "gate_up_3x": ("merged", 2688, [6144, 6144], 3.0),
    "down": ("row", 6144, [2688], None),
    "markov_w2": ("lm_head", 512, [131072], None),
}
VLLM_ERR = "rel_max_err_vllm_modelopt_fp4"
QUANT_CONFIG = {"quant_method": "modelopt", "quant_algo": "W4A16_NVFP4", "group_size": 16}


def gaussian_weight(rows: int, cols: int, seed: int, device, std: float = 0.02) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(rows, cols, generator=g, device=device) * std
    w[0, :8] *= 8  # a few outliers, as real weights have
    return w


def make_shards(case: str, device) -> list[nvfp4.NVFP4Weight]:
    """ModelOpt-style NVFP4 tensors for each shard of ``case``."""
    kind, k, outs, ratio = CASES[case]
    if ratio is None:
        return [nvfp4.quantize(gaussian_weight(outs[0], k, 1, device))]
    up_dense = gaussian_weight(outs[1], k, 3, device)
    up = nvfp4.quantize(up_dense)
    if ratio == 1.0:  # one shared global scale: the amax over both shards
        gate_dense = gaussian_weight(outs[0], k, 2, device)
        amax = max(float(gate_dense.abs().max()), float(up_dense.abs().max()))
        shared = amax / (nvfp4.E2M1_MAX * nvfp4.FP8_E4M3_MAX)
        return [nvfp4.quantize(gate_dense, shared), nvfp4.quantize(up_dense, shared)]
    gate_scale = float(up.weight_scale_2) / ratio
    gate = nvfp4.quantize(gaussian_weight(outs[0], k, 2, device, std=0.02 / ratio), gate_scale)
    return [gate, up]


def build_layer(case: str, quant_config, dtype):
    """The vLLM layer of ``case``, built with ``quant_config`` (None: unquantized)."""
    from vllm.model_executor.layers.linear import (
        MergedColumnParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    kind, k, outs, _ = CASES[case]
    common = dict(quant_config=quant_config, params_dtype=dtype, prefix=f"bench.{case}")
    if kind == "replicated":
        layer = ReplicatedLinear(k, outs[0], bias=False, **common)
    elif kind == "merged":
        layer = MergedColumnParallelLinear(k, outs, bias=False, **common)
    elif kind == "row":
        layer = RowParallelLinear(k, outs[0], bias=False, **common)
    else:
        layer = ParallelLMHead(outs[0], k, bias=False, disable_tp=True, **common)
    return layer


def load(layer, case, tensors_per_shard):
    """Load checkpoint tensors (one dict per shard) through the weight loaders, then process."""
    kind = CASES[case][0]
    for shard_id, tensors in enumerate(tensors_per_shard):
        for name, tensor in tensors.items():
            param = getattr(layer, name)
            if kind == "merged":
                param.weight_loader(param, tensor, shard_id)
            else:
                param.weight_loader(param, tensor)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def dense_layer(case, weight: torch.Tensor):
    """The same vLLM layer unquantized, holding ``weight`` (fused layers get one fused tensor)."""
    layer = build_layer(case, None, weight.dtype)
    layer.weight.weight_loader(layer.weight, weight)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def nvfp4_tensors(q: nvfp4.NVFP4Weight) -> dict[str, torch.Tensor]:
    return {"weight": q.weight, "weight_scale": q.weight_scale, "weight_scale_2": q.weight_scale_2}


class OnTheFly:
    """Keeps the packed tensors and dequantizes in every call (the CPU alternative measured here).
    Same arithmetic order as the reference: (E2M1 * block scale) * global scale, in fp32."""

    def __init__(self, shards: list[nvfp4.NVFP4Weight], dtype):
        lut = nvfp4.e2m1_table()
        byte = torch.arange(256)
        self.pair_lut = torch.stack([lut[byte & 15], lut[byte >> 4]], dim=-1)  # [256, 2]
        self.shards = [(q.weight, q.weight_scale, q.weight_scale_2) for q in shards]
        self.dtype = dtype

    def weight(self) -> torch.Tensor:
        parts = []
        for packed, scale, global_scale in self.shards:
            rows, half = packed.shape
            values = F.embedding(packed.to(torch.int32), self.pair_lut)  # [rows, in/2, 2]
            values = values.view(rows, half * 2 // nvfp4.GROUP_SIZE, nvfp4.GROUP_SIZE)
            parts.append(((values * scale.float().unsqueeze(-1)) * global_scale).view(rows, -1))
        return torch.cat(parts).to(self.dtype)

    def __call__(self, x):
        return F.linear(x, self.weight())

    def bytes(self) -> int:
        return sum(p.numel() + s.numel() + 4 for p, s, _ in self.shards)


def rel_max_error(y: torch.Tensor, reference: torch.Tensor) -> float:
    return float((y.double() - reference).abs().max() / reference.abs().max())


def time_cpu(fn, x, reps: int) -> float:
    fn(x)  # warm-up
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn(x)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def time_gpu(fn, x, calls: int = 20, replays: int = 10) -> tuple[float, str]:
    """Microseconds per call: a CUDA graph of ``calls`` calls replayed ``replays`` times (eager
    loop where capture fails)."""
    for _ in range(3):
        fn(x)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    try:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn(x)
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(calls):
                    fn(x)
        torch.cuda.current_stream().wait_stream(stream)
        graph.replay()
        torch.cuda.synchronize()
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3 / (calls * replays), "cuda graph"
    except Exception as exc:  # noqa: BLE001 - report and fall back
        print(f"  (CUDA graph capture failed: {type(exc).__name__}: {exc}; timing eagerly)")
        torch.cuda.synchronize()
        start.record()
        for _ in range(calls * replays):
            fn(x)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3 / (calls * replays), "eager"


def init_vllm(device: str) -> bool:
    """vLLM's distributed state at world size 1, unless it exists; True if this call made it."""
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        return False
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ps.init_distributed_environment(
        world_size=1,
        rank=0,
        local_rank=0,
        distributed_init_method=f"tcp://127.0.0.1:{port}",
        backend="nccl" if device == "cuda" else "gloo",
    )
    ps.initialize_model_parallel(1)
    return True


def device_facts(device: str) -> dict:
    """The device the layers ran on (beside the run's setup facts)."""
    if device == "cuda":
        return {"gpu": torch.cuda.get_device_name(0),
                "capability": ".".join(map(str, torch.cuda.get_device_capability(0)))}  # fmt: skip
    return {"torch_threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}  # fmt: skip


# Kernels that add their split-K (stream-K) partial sums in the output dtype: each slice's partial
# product is rounded to bf16 before the add (humming 0.1.19, epilogue/gmem_writer.cuh; used when
# K > 1024), so their error is a few bf16 units of the output, not the one rounding of an fp32 sum.
BF16_REDUCING_KERNELS = frozenset({"HummingNvFp4LinearKernel"})


def gpu_tolerance(kernel: str, err_bf16: float) -> float:
    """The largest relative max error accepted from ``kernel``. Kernels that sum in fp32: twice the
    bf16 baseline's error (bf16(W_ref) in cuBLAS) plus one bf16 unit of the output (2**-9). Kernels
    that reduce in bf16: 8 bf16 units (2**-6), room for one rounding per slice. Either way far
    below what a wrong nibble order, a mis-scaled shard or another rank's part costs (0.3-1)."""
    if kernel in BF16_REDUCING_KERNELS:
        return 2**-6
    return min(2 * err_bf16 + 2**-9, 2**-6)


def run_case_gpu(case, shards, qc, ms, record, failures):
    from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config

    dtype = torch.bfloat16
    outs = CASES[case][2]
    reference_w = torch.cat([q.dequantize(torch.float32) for q in shards])
    layer = load(build_layer(case, qc, dtype), case, [nvfp4_tensors(q) for q in shards])
    method = layer.quant_method
    shard_kernels = method.shard_kernels
    path = "one GEMM" if shard_kernels is None else f"{len(shard_kernels)} GEMMs (per shard)"
    kernel = type(method.kernel).__name__
    expected_path = "one GEMM" if CASES[case][3] in (None, 1.0, 4.0) else "2 GEMMs (per shard)"
    if path != expected_path:
        failures.append(f"{case}: took path {path!r}, expected {expected_path!r}")
    dense = dense_layer(case, reference_w.to(dtype))
    vllm_layer = None
    if CASES[case][3] not in (None, 1.0):  # vLLM's own modelopt_fp4 method, for comparison
        vllm_qc = ModelOptNvFp4Config.from_config(QUANT_CONFIG)
        tensors = [nvfp4_tensors(q) for q in shards]
        vllm_layer = load(build_layer(case, vllm_qc, dtype), case, tensors)
    rows = []
    for m in ms:
        g = torch.Generator(device="cuda").manual_seed(m)
        x = torch.randn(m, CASES[case][1], device="cuda", generator=g).to(dtype)
        reference = x.double() @ reference_w.double().T
        n = sum(outs)
        y = method.apply(layer, x)[..., :n]
        y_bf16 = F.linear(x, reference_w.to(dtype))
        err, err_bf16 = rel_max_error(y, reference), rel_max_error(y_bf16, reference)
        tol = gpu_tolerance(kernel, err_bf16)
        ok = err <= tol and y.dtype == dtype and bool(torch.isfinite(y).all())
        if not ok:
            failures.append(f"{case} M={m}: rel max error {err:.3e} > tolerance {tol:.3e}")
        t_nvfp4, how = time_gpu(lambda a: method.apply(layer, a), x)
        t_bf16, _ = time_gpu(lambda a: dense.quant_method.apply(dense, a), x)
        row = {
            "case": case, "m": m, "kernel": kernel, "path": path, "rel_max_err": err,
            "rel_max_err_bf16": err_bf16, "tolerance": tol, "ok": ok,
            "us_nvfp4": t_nvfp4, "us_bf16": t_bf16, "timing": how,
        }  # fmt: skip
        if vllm_layer is not None:
            y_vllm = vllm_layer.quant_method.apply(vllm_layer, x)[..., :n]
            row[VLLM_ERR] = rel_max_error(y_vllm, reference)
        rows.append(row)
        print(
            f"  {case:11s} M={m:3d} {kernel} [{path}] err {err:.2e} (bf16 {err_bf16:.2e},"
            f" tol {tol:.2e}) {'ok' if ok else 'FAIL'} | {t_nvfp4:8.1f} us vs bf16 {t_bf16:8.1f} us"
            + (f" | vLLM modelopt_fp4 err {row[VLLM_ERR]:.2e}" if vllm_layer else "")
        )
    record.extend(rows)


def run_case_cpu(case, shards, qc, ms, reps, record, failures):
    outs = CASES[case][2]
    n = sum(outs)
    for dtype in (torch.float32, torch.bfloat16):
        reference_w = torch.cat([q.dequantize(dtype) for q in shards])
        t0 = time.perf_counter()
        layer = load(build_layer(case, qc, dtype), case, [nvfp4_tensors(q) for q in shards])
        load_s = time.perf_counter() - t0
        fly = OnTheFly(shards, dtype)
        dense = dense_layer(case, reference_w)  # vLLM's unquantized layer (oneDNN on CPU)
        for m in ms:
            x = torch.randn(m, CASES[case][1], generator=torch.Generator().manual_seed(m)).to(dtype)
            expected = x @ reference_w.T
            y = layer.quant_method.apply(layer, x)[..., :n]
            exact = torch.equal(y, expected) and torch.equal(fly(x), expected)
            if not exact:
                failures.append(f"{case} {dtype} M={m}: CPU output differs from x @ W_ref.T")
            row = {
                "case": case, "dtype": str(dtype).removeprefix("torch."), "m": m, "exact": exact,
                "us_at_load": time_cpu(lambda a: layer.quant_method.apply(layer, a), x, reps),
                "us_on_the_fly": time_cpu(fly, x, max(1, reps // 2)),
                "us_vllm_dense": time_cpu(lambda a: dense.quant_method.apply(dense, a), x, reps),
                "bytes_at_load": layer.weight.numel() * layer.weight.element_size(),
                "bytes_on_the_fly": fly.bytes(), "load_s": load_s,
            }  # fmt: skip
            record.append(row)
            print(
                f"  {case:11s} {row['dtype']:8s} M={m:3d} exact={exact}"
                f" | at load {row['us_at_load']:9.0f} us | on the fly {row['us_on_the_fly']:9.0f} us"
                f" | vLLM dense {row['us_vllm_dense']:9.0f} us"
            )


TP_KINDS = {"merged": "column", "row": "row", "lm_head": "vocab"}  # how each kind splits under TP


class faked_tp:
    """Within the block, vLLM's layers and parameters built see ``rank`` of ``size`` as their
    tensor-parallel rank and world size (where they read them: no process group involved)."""

    MODULES = (
        "vllm.model_executor.parameter",
        "vllm.model_executor.layers.linear",
        "vllm.model_executor.layers.vocab_parallel_embedding",
    )

    def __init__(self, rank: int, size: int):
        self.rank, self.size, self.saved = rank, size, []

    def __enter__(self):
        import importlib

        for name in self.MODULES:
            module = importlib.import_module(name)
            for attr, value in (
                ("get_tensor_model_parallel_rank", self.rank),
                ("get_tensor_model_parallel_world_size", self.size),
            ):
                self.saved.append((module, attr, getattr(module, attr)))
                setattr(module, attr, lambda v=value: v)
        return self

    def __exit__(self, *exc):
        for module, attr, value in reversed(self.saved):
            setattr(module, attr, value)


def build_tp_layer(case: str, quant_config, dtype):
    """``case``'s layer as it is under tensor parallelism (markov_w2: vocab-parallel)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    kind, k, outs, _ = CASES[case]
    if kind != "lm_head":
        return build_layer(case, quant_config, dtype)
    return ParallelLMHead(
        outs[0], k, bias=False, quant_config=quant_config, params_dtype=dtype,
        prefix=f"bench.{case}",
    )  # fmt: skip


def rank_part(case: str, reference_w: torch.Tensor, rank: int, tp: int, layer) -> tuple:
    """(rows, cols) of the full dequantized weight that ``rank`` must hold; rows as an index
    tensor (fused shards: each shard's part), cols as a slice."""
    kind, k, outs, _ = CASES[case]
    device = reference_w.device
    if kind == "row":
        return torch.arange(sum(outs), device=device), slice(rank * k // tp, (rank + 1) * k // tp)
    if kind == "lm_head":
        per_rank = layer.num_embeddings_per_partition
        start = rank * per_rank
        rows = torch.arange(start, min(start + per_rank, outs[0]), device=device)
        return rows, slice(0, k)
    parts, offset = [], 0
    for width in outs:
        per = width // tp
        parts.append(torch.arange(offset + rank * per, offset + (rank + 1) * per, device=device))
        offset += width
    return torch.cat(parts), slice(0, k)


def run_case_tp(case, shards, qc, ms, tp, device, record, failures):
    kind, k, outs, _ = CASES[case]
    dtype = torch.bfloat16
    reference_w = torch.cat([q.dequantize(torch.float32) for q in shards])
    # CPU: the plugin's layer computes with the weight dequantized in its dtype, bit for bit
    exact_w = None if device.type == "cuda" else torch.cat([q.dequantize(dtype) for q in shards])
    tensors = [nvfp4_tensors(q) for q in shards]
    full = load(build_layer(case, qc, dtype), case, tensors) if device.type == "cuda" else None
    xs = {
        m: torch.randn(
            m, k, device=device, generator=torch.Generator(device=device).manual_seed(m)
        ).to(dtype)
        for m in ms
    }
    partial_sums = {m: None for m in ms}
    for rank in range(tp):
        with faked_tp(rank, tp):
            layer = load(build_tp_layer(case, qc, dtype), case, tensors)
        method = layer.quant_method
        rows, cols = rank_part(case, reference_w, rank, tp, layer)
        part_w = reference_w[rows][:, cols]
        n = part_w.shape[0]
        if device.type != "cuda":
            path, kernel = "dequantized at load", None
        else:
            path = "one GEMM" if method.shard_kernels is None else "one GEMM per shard"
            kernel = type(method.kernel).__name__
        for m in ms:
            x = xs[m][:, cols].contiguous()
            y = method.apply(layer, x)[..., :n]  # lm_head: padding rows after the vocabulary
            reference = x.double() @ part_w.double().T
            if device.type == "cuda":
                err = rel_max_error(y, reference)
                err_bf16 = rel_max_error(F.linear(x, part_w.to(dtype)), reference)
                tol = gpu_tolerance(kernel, err_bf16)
                ok = err <= tol and bool(torch.isfinite(y).all())
            else:
                err, err_bf16, tol = rel_max_error(y, reference), None, 0.0
                ok = torch.equal(y, x @ exact_w[rows][:, cols].T)
            vs_tp1 = None
            if full is not None and kind != "row":
                y_full = full.quant_method.apply(full, xs[m])[..., : sum(outs)]
                vs_tp1 = float((y.float() - y_full[..., rows].float()).abs().max())
            if kind == "row":
                partial_sums[m] = y.double() if partial_sums[m] is None else partial_sums[m] + y
            if not ok:
                failures.append(
                    f"{case} tp={tp} rank={rank} M={m}: rel max error {err:.3e} > tolerance {tol:.3e}"
                    if device.type == "cuda"
                    else f"{case} tp={tp} rank={rank} M={m}: CPU output differs from x @ W_ref[part].T"
                )
            record.append({
                "case": case, "tp": tp, "rank": rank, "split": TP_KINDS[kind], "m": m,
                "rows": n, "cols": cols.stop - cols.start, "path": path,
                "kernel": kernel, "rel_max_err": err,
                "rel_max_err_bf16": err_bf16, "tolerance": tol, "ok": ok,
                "max_abs_diff_vs_tp1_slice": vs_tp1,
            })  # fmt: skip
            print(
                f"  {case:11s} tp={tp} rank={rank} M={m:3d} [{TP_KINDS[kind]}, {n}x{cols.stop - cols.start},"
                f" {path}] err {err:.2e} {'ok' if ok else 'FAIL'}"
                + ("" if vs_tp1 is None else f" | vs TP=1 slice {vs_tp1:.2e}")
            )
        del layer
    if kind == "row":
        for m in ms:
            reference = xs[m].double() @ reference_w.double().T
            err = rel_max_error(partial_sums[m], reference)
            print(f"  {case:11s} tp={tp} all-reduced M={m:3d} err {err:.2e}")
            record.append({"case": case, "tp": tp, "rank": "sum", "split": "row", "m": m,
                           "rel_max_err": err, "ok": True})  # fmt: skip
