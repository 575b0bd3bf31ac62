"""``tune``: measure a draft's acceptance and the engine's decode step time per (batch size, k) on
this machine, and choose the per-batch-size speculation schedule that maximises output tokens/s.

The engine is configured as a schedule serves it: a step drafts k and verifies them (DSpark, whose
block attention is causal: ``patches/v2_dspark_draft_k.py`` on vLLM's V2 runner, the plugin's
proposer on V1), or drafts the whole block of ``num_speculative_tokens`` and verifies the first k
(DFlash); k = 0: no query pass, the draft only stores the new tokens' context. One engine measures
every k: it starts with ``num_speculative_tokens`` = the largest k measured (the block) and a
schedule naming every measured k (so the runner captures a CUDA graph for each), and each
measurement sets the k of the running engine for every batch size
(``patches/engine_core_spec_tokens.py``), exactly what an engine serving the one-range schedule
``[[1, max_batch, k]]`` runs. Acceptance (vLLM's per-position accepted counters) is measured once,
at the largest k, on the user's prompts: the first k drafts of a step do not depend on k, so one
measurement gives ``E[accepted | k]`` for every k (``bench.schedule``). A second engine without
speculation then times plain decoding at every batch size (k=0 in the measuring engine is not plain
decoding: the draft still stores each step's context), so the report says where plain decoding
serves more than the schedule.

A step time is the median of the gaps between vLLM's engine-core timestamps of consecutive
decode steps in which exactly B requests were in flight: B requests with equal, long
``max_tokens`` and ``ignore_eos`` are added together, steps before all of them have their first
token are skipped, then ``warmup_steps`` more, then ``steps`` steps are timed and the requests
aborted (none finishes while measured). Everything vLLM-specific is imported inside functions.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

from vllm_nemotron_spec.bench.schedule import (
    ScheduleError,
    batch_grid,
    choose_schedule,
    expected_accepted,
    merge_ranges,
    rate_table,
    speculative_config,
)
from vllm_nemotron_spec.runs import SpecCounters

SCHEMA = "vllm-nemotron-spec.tune/5"

SCATTER_LIMIT = 0.25
"""A (batch, k) point whose step-time quartiles lie further apart than this share of the median
is reported as scattered: other work on the machine, or too few ``--steps``."""


class TuneError(ScheduleError):
    """A tune run that cannot start or finish; the message says what was expected."""


@dataclass(frozen=True)
class TunePlan:
    """What one tune run measures (validated by :func:`plan_tune` before any engine starts)."""

    target: str
    method: str
    draft: str  # as vLLM takes it: an absolute directory or a Hub id
    ks: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    block_limit: int | None  # the largest k the draft's trained block allows (None: not declared)
    temperature: float = 0.0
    steps: int = 16
    warmup_steps: int = 4
    max_tokens: int = 128  # per prompt, for the acceptance measurement
    ignore_eos: bool = False
    plain: bool = True  # also time plain decoding (one more engine, no speculation)
    speculative_extra: dict = field(default_factory=dict)
    engine_kwargs: dict = field(default_factory=dict)

    @property
    def block(self) -> int:
        """The drafted block of every measuring engine: the largest k measured."""
        return max(self.ks)

    @property
    def max_num_seqs(self) -> int:
        """The engine's request slots: the largest batch measured, and at least one batch size
        per measured k (the start-up schedule gives each k its own)."""
        asked = self.engine_kwargs.get("max_num_seqs") or 0
        return max(asked, max(self.batch_sizes), len(self.ks))

    def speculative_config(self) -> dict:
        """The measuring engine: the block as ``num_speculative_tokens``, and a schedule naming
        every measured k, the block over the largest batch sizes (the runner captures a CUDA graph
        for each k of the schedule; each measurement then sets one k for every batch size)."""
        rest = sorted(k for k in self.ks if k != self.block)
        ranges = [[i + 1, i + 1, k] for i, k in enumerate(rest)]
        ranges.append([len(rest) + 1, self.max_num_seqs, self.block])
        return {
            "method": self.method,
            "model": self.draft,
            **self.speculative_extra,
            "num_speculative_tokens": self.block,
            "num_speculative_tokens_per_batch_size": ranges,
        }

    @property
    def k_order(self) -> list[int]:
        """The largest k first (it also measures acceptance, so a draft that cannot run fails
        before any timing), then the others ascending."""
        top = max(self.ks)
        return [top] + sorted(k for k in self.ks if k != top)


def plan_tune(
    target: str,
    method: str,
    draft: str,
    *,
    ks: list[int] | None = None,
    max_batch: int = 16,
    **options,
) -> TunePlan:
    """Check the pair and the options and return the plan; raise :class:`TuneError` naming the
    problem (a draft that is not a Nemotron 3.5 ``method`` draft for this NemotronH target, a k
    above the draft's trained block, a batch grid below 1, ...). Nothing here starts vLLM."""
    from vllm_nemotron_spec.commands import model_argument

    grid = batch_grid(max_batch)
    _check_options(options)
    spec = checked_draft(target, method, draft)
    return TunePlan(
        target=model_argument(target),
        method=method,
        draft=model_argument(draft),
        ks=tuple(checked_ks(spec, ks)),
        batch_sizes=tuple(grid),
        block_limit=spec.max_num_speculative_tokens,
        **options,
    )


def checked_draft(target: str, method: str, draft: str):
    """The draft's DraftSpec, once it is known to be a Nemotron 3.5 ``method`` draft whose config
    and tensor headers fit the NemotronH ``target`` (the checks of ``inspect`` and start-up)."""
    from vllm_nemotron_spec.checkpoint.check import check_draft
    from vllm_nemotron_spec.checkpoint.headers import load_config
    from vllm_nemotron_spec.checkpoint.spec import DraftSpec, DraftSpecError

    try:
        config, _ = load_config(draft, "draft")
        spec = DraftSpec.from_config(config, path=draft)
    except DraftSpecError as exc:
        raise TuneError(f"--draft {draft}: {'; '.join(exc.problems)}") from None
    if not spec.is_nemotron35:
        raise TuneError(
            f"--draft {draft}: a {spec.architecture} draft without the Nemotron 3.5 layout "
            "(its own embed_tokens, the target's lm_head, eagle_aux_hidden_state_layer_ids, "
            "dflash_config); tune serves the Nemotron 3.5 DFlash / DSpark drafts"
        )
    if spec.method != method:
        raise TuneError(
            f"--method {method}: the draft is a {spec.method} draft ({spec.architecture}); "
            f"use --method {spec.method}"
        )
    problems = check_draft(draft, target, draft_config=config, method=method).problems
    if problems:
        more = len(problems) - 4
        raise TuneError(
            f"--draft {draft} with target {target}: "
            + "; ".join(problems[:4])
            + (f"; and {more} more (see `vllm-nemotron-spec inspect`)" if more > 0 else "")
        )
    return spec


def checked_ks(spec, ks: list[int] | None) -> list[int]:
    """The k values to measure, sorted: ``ks`` checked against the draft's trained block, or
    every k from 0 to it (DFlash without a declared block: to its default, 5)."""
    from vllm_nemotron_spec.checkpoint.spec import DraftSpecError

    if ks is None:
        top = spec.max_num_speculative_tokens or spec.default_num_speculative_tokens
        if top is None:
            raise TuneError("the draft declares no block_size: give the k values to measure, --k")
        ks = list(range(0, top + 1))
    for k in ks:
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise TuneError(f"--k: every k must be an integer >= 0, found {k!r}")
        if k:
            try:
                spec.resolve_num_speculative_tokens(k)
            except DraftSpecError as exc:
                raise TuneError(f"--k {k}: {'; '.join(exc.problems)}") from None
    if not any(ks):
        raise TuneError("--k: nothing to tune; give at least one k >= 1 (and 0 for no drafts)")
    return sorted(set(ks))


def _check_options(options: dict) -> None:
    for name in ("steps", "max_tokens"):
        if name in options and options[name] < 1:
            raise TuneError(f"--{name.replace('_', '-')} must be >= 1, found {options[name]}")
    if options.get("warmup_steps", 0) < 0:
        raise TuneError(f"--warmup-steps must be >= 0, found {options['warmup_steps']}")
    if options.get("temperature", 0.0) < 0:
        raise TuneError(f"--temperature must be >= 0, found {options['temperature']}")
    reserved = {
        "method",
        "model",
        "num_speculative_tokens",
        "num_speculative_tokens_per_batch_size",
    }
    clash = sorted(reserved & set(options.get("speculative_extra", {})))
    if clash:
        raise TuneError(f"--speculative-arg: {', '.join(clash)} is set by tune itself")


# --------------------------------------------------------------------------------------------
# Measurements.


@dataclass
class StepTiming:
    """The decode steps of one (batch size, k) measurement."""

    batch: int
    k: int
    seconds: list[float]  # one per measured step
    tokens: list[int]  # tokens emitted by the batch in each measured step

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens per request per measured step (1 + accepted drafts)."""
        return sum(self.tokens) / (len(self.tokens) * self.batch)

    @property
    def quartiles_s(self) -> tuple[float, float]:
        if len(self.seconds) < 2:
            return self.seconds[0], self.seconds[0]
        q = statistics.quantiles(self.seconds, n=4)
        return q[0], q[2]

    @property
    def scattered(self) -> bool:
        q1, q3 = self.quartiles_s
        return q3 - q1 > SCATTER_LIMIT * self.median_s

    def to_json(self) -> dict:
        q1, q3 = self.quartiles_s
        return {
            "batch": self.batch,
            "k": self.k,
            "step_ms": round(1000 * self.median_s, 4),
            "step_ms_quartiles": [round(1000 * q1, 4), round(1000 * q3, 4)],
            "steps": len(self.seconds),
            "measured_tokens_per_step": round(self.tokens_per_step, 4),
        }


def tokens_to_request(wanted: int, k: int, prompt_tokens: int, scheduler_config) -> int:
    """``max_tokens`` for each of a batch's requests such that none finishes before ``wanted``
    steps in which all of them decode: a step emits at most ``k + 1`` tokens per request, and
    the first requests decode while the batch's later prompts are still prefilling (chunked,
    ``max_num_batched_tokens`` per step), up to one step per chunk of the batch's prompts."""
    budget = max(1, int(scheduler_config.max_num_batched_tokens))
    prefill_steps = -(-prompt_tokens // budget)  # ceil
    return (wanted + prefill_steps + 2) * (k + 1)


def time_decode_steps(
    llm, prompt_ids: list[list[int]], batch: int, k: int, plan: TunePlan
) -> StepTiming:
    """Time ``plan.steps`` decode steps with exactly ``batch`` requests in flight (module
    docstring); the requests are aborted afterwards."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    chosen = [prompt_ids[i % len(prompt_ids)] for i in range(batch)]
    wanted = plan.warmup_steps + plan.steps + 1  # stamps: one more than the gaps timed
    longest = max(len(p) for p in chosen)
    max_tokens = tokens_to_request(
        wanted, k, sum(len(p) for p in chosen), engine.vllm_config.scheduler_config
    )
    max_len = engine.model_config.max_model_len
    if longest + max_tokens > max_len:
        raise TuneError(
            f"batch {batch}, k {k}: a prompt of {longest} tokens + {max_tokens} generated "
            f"tokens exceeds max_model_len {max_len}; use shorter prompts, fewer --steps, or "
            "--engine-arg max_model_len=N"
        )
    tag = uuid.uuid4().hex[:8]
    ids = [f"tune-{tag}-b{batch}-k{k}-{i}" for i in range(batch)]
    for i, (rid, prompt) in enumerate(zip(ids, chosen)):
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=plan.temperature,
            ignore_eos=True,
            seed=i if plan.temperature > 0 else None,
            output_kind=RequestOutputKind.DELTA,
        )
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    try:
        stamps, tokens = _steady_steps(engine, set(ids), wanted)
    finally:
        _abort(engine, ids)
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    skip = plan.warmup_steps
    return StepTiming(batch, k, gaps[skip:], tokens[1 + skip :])


def _steady_steps(engine, ids: set[str], wanted: int) -> tuple[list[float], list[int]]:
    """Engine-core timestamps and emitted tokens of ``wanted`` consecutive steps in which every
    request of ``ids`` decoded (each had its first token before the step) and none finished."""
    started: set[str] = set()
    stamps: list[float] = []
    tokens: list[int] = []
    while len(stamps) < wanted:
        if not engine.has_unfinished_requests():
            raise TuneError(
                f"the {len(ids)} requests finished after {len(stamps)} steady decode steps, "
                f"before the {wanted} needed (preempted? try a smaller --max-batch)"
            )
        outs = [o for o in engine.step() if o.request_id in ids]
        full = (
            len(outs) == len(ids)
            and all(o.request_id in started for o in outs)
            and not any(o.finished for o in outs)
        )
        started.update(o.request_id for o in outs)
        if not full:
            stamps, tokens = [], []  # the run of full steps starts again
            continue
        stamps.append(_stamp(outs[0]))
        tokens.append(sum(len(o.outputs[0].token_ids) for o in outs))
    return stamps, tokens


def _stamp(output) -> float:
    """The engine-core timestamp of the step that produced ``output`` (vLLM's per-request
    ``last_token_ts``; right for an engine core in another process), else the time now."""
    ts = getattr(getattr(output, "metrics", None), "last_token_ts", 0.0)
    return float(ts) if ts else time.monotonic()


def _abort(engine, ids: list[str]) -> None:
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()


def measure_acceptance(
    llm, prompt_ids: list[list[int]], temperature: float, plan: TunePlan
) -> SpecCounters:
    """vLLM's spec-decode counters over one generate of every prompt (``plan.max_tokens`` each;
    seeded per prompt when sampling)."""
    from vllm import SamplingParams

    from vllm_nemotron_spec.runs import read_spec_counters

    params = [
        SamplingParams(
            max_tokens=plan.max_tokens,
            temperature=temperature,
            ignore_eos=plan.ignore_eos,
            seed=i if temperature > 0 else None,
        )
        for i in range(len(prompt_ids))
    ]
    before = read_spec_counters(llm)
    llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
    counters = read_spec_counters(llm).minus(before)
    if counters.num_drafts <= 0 or not counters.accepted_per_position:
        raise TuneError(
            f"no drafting step at temperature {temperature}: the prompts ended before any "
            "draft was verified; use more --max-tokens or --ignore-eos"
        )
    return counters


class Progress:
    """One stderr line per measurement, with an ETA from the mean duration of each kind of work
    (the first engine start, measurements, later engine starts: faster, compilation is cached)
    done so far."""

    STARTS = ("start", "restart")

    def __init__(self, starts: int, measures: int, enabled: bool = True, restarts: int = 0):
        self.left = {"start": starts, "measure": measures, "restart": restarts}
        self.spent: dict[str, list[float]] = {kind: [] for kind in self.left}
        self.total = starts + measures + restarts
        self.enabled = enabled

    def done(self, kind: str, seconds: float, message: str) -> None:
        self.left[kind] -= 1
        self.spent[kind].append(seconds)
        n = self.total - sum(self.left.values())
        self.say(f"tune [{n}/{self.total}] {message} ({seconds:.1f} s; {self.eta()})")

    def eta(self) -> str:
        """The work left at the mean duration of its kind so far; unknown while measurements
        still to come have not been timed once (an engine start says nothing of a measurement),
        and engine starts not timed yet are named instead of guessed."""
        left = {kind: n for kind, n in self.left.items() if n > 0}
        untimed = [kind for kind in left if not self.spent[kind]]
        if any(kind not in self.STARTS for kind in untimed):
            return "ETA unknown"
        seconds = sum(
            n * statistics.mean(self.spent[k]) for k, n in left.items() if k not in untimed
        )
        starts = sum(left[kind] for kind in untimed)
        if starts:
            more = "an engine start" if starts == 1 else f"{starts} engine starts"
            return f"ETA {_duration(seconds)} + {more}"
        return f"ETA {_duration(seconds)}" if seconds > 0 else "done"

    def say(self, message: str) -> None:
        if self.enabled:
            print(message, file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def waiting(self, what: str, every_s: float = 30.0):
        """A line every ``every_s`` seconds while the block runs (an engine start on a GPU takes
        minutes, with vLLM's own log at WARNING)."""
        done, t0 = threading.Event(), time.perf_counter()

        def beat():
            while not done.wait(every_s):
                self.say(f"tune: {what} ({_duration(time.perf_counter() - t0)} so far)")

        thread = threading.Thread(target=beat, name="tune-progress", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


@dataclass
class Measurements:
    acceptance: dict[str, SpecCounters]  # "greedy", and "sampled" with a temperature
    timings: list[StepTiming]
    seconds: float
    engine_start_s: float  # the measuring engine's start and first warm-up
    plain: list[StepTiming] = field(default_factory=list)  # k=0 of an engine without drafts
    plain_start_s: float | None = None
    drafts_only_k: list[int] = field(default_factory=list)  # k whose steps draft k, not the block


def run_tune(plan: TunePlan, prompts: list[str], progress: bool = True) -> Measurements:
    """Start the measuring engine, then for each k (:attr:`TunePlan.k_order`) set it on the
    running engine and time every batch size; release the engine."""
    from vllm_nemotron_spec import patches, plugin
    from vllm_nemotron_spec.patches.engine_core_spec_tokens import PATCH, set_engine_num_spec_tokens
    from vllm_nemotron_spec.runs import make_llm, release

    plugin.register()  # what vLLM does at engine start; idempotent
    patches.require("tune (one engine for every k)", PATCH)  # before any engine starts
    start = time.perf_counter()
    runs = 2 if plan.temperature > 0 else 1
    plain_runs = len(plan.batch_sizes) if plan.plain else 0
    meter = Progress(
        1, len(plan.ks) * len(plan.batch_sizes) + runs + plain_runs, progress, int(plan.plain)
    )
    out = Measurements({}, [], 0.0, 0.0)
    label = f"{plan.method} block {plan.block}"
    meter.say(f"tune: starting the engine for {label}, k {', '.join(map(str, plan.k_order))}")
    kwargs = {**plan.engine_kwargs, "max_num_seqs": plan.max_num_seqs}
    with meter.waiting("the engine is starting: loading, compiling, capturing CUDA graphs"):
        llm = make_llm(plan.target, plan.speculative_config(), **kwargs)
    try:
        out.drafts_only_k = engine_drafts_only_k(llm)
        tokenizer = llm.get_tokenizer()
        prompt_ids = [list(tokenizer.encode(p)) for p in prompts]
        for i, k in enumerate(plan.k_order):
            set_engine_num_spec_tokens(llm, k)
            warm_up(llm, prompt_ids, max(plan.batch_sizes), k)
            name = f"{label}, k={k}" + (" (no drafts)" if k == 0 else "")
            if i == 0:
                out.engine_start_s = time.perf_counter() - start
                meter.done("start", out.engine_start_s, f"engine for {label} started, warmed up")
                _measure_acceptance_runs(llm, prompt_ids, plan, name, meter, out)
            out.timings += time_every_batch(llm, prompt_ids, k, plan, meter, name)
    finally:
        release(llm)
    if plan.plain:  # the target's tokenizer: the prompt ids serve both engines
        time_plain_decoding(plan, prompt_ids, kwargs, meter, out)
    out.seconds = time.perf_counter() - start
    return out


def engine_drafts_only_k(llm) -> list[int]:
    """The k whose steps draft only k in this engine (a causal DSpark draft), read from its
    workers."""
    return sorted(set().union(*map(set, llm.collective_rpc(drafts_only_k_in_worker))))


def drafts_only_k_in_worker(worker) -> list[int]:
    """In a worker (``LLM.collective_rpc``): the k with a layout of their own in vLLM's V2
    speculator (``patches/v2_dspark_draft_k.py``), or on the V1 runner every k below the block
    when the plugin's proposer drafts only k; [] where every step drafts the block."""
    from vllm_nemotron_spec.patches.v2_dspark_draft_k import LAYOUTS

    runner = worker.model_runner
    speculator = getattr(runner, "speculator", None)
    if speculator is not None:
        return sorted(getattr(speculator, LAYOUTS, None) or {})
    drafter = getattr(runner, "drafter", None)
    if getattr(drafter, "drafts_only_k", False):
        return list(range(1, drafter.block_num_speculative_tokens))
    return []


def time_plain_decoding(
    plan: TunePlan, prompt_ids: list[list[int]], kwargs: dict, meter, out
) -> None:
    """The baseline: an engine with the same settings and no speculation, each batch size timed
    as the measuring engine's (one token a request a step)."""
    from vllm_nemotron_spec.runs import make_llm, release

    t0 = time.perf_counter()
    meter.say("tune: starting the engine for plain decoding (no speculation)")
    with meter.waiting("the plain-decoding engine is starting"):
        llm = make_llm(plan.target, None, **kwargs)
    try:
        warm_up(llm, prompt_ids, max(plan.batch_sizes), 0)
        out.plain_start_s = time.perf_counter() - t0
        meter.done("restart", out.plain_start_s, "engine for plain decoding started, warmed up")
        out.plain = time_every_batch(llm, prompt_ids, 0, plan, meter, "plain decoding")
    finally:
        release(llm)


def time_every_batch(llm, prompt_ids, k: int, plan: TunePlan, meter, name: str) -> list:
    """:func:`time_decode_steps` at every batch size of the plan, a progress line each."""
    timings = []
    for b in plan.batch_sizes:
        t0 = time.perf_counter()
        timing = time_decode_steps(llm, prompt_ids, b, k, plan)
        timings.append(timing)
        meter.done(
            "measure",
            time.perf_counter() - t0,
            f"{name}, batch {b}: step {1000 * timing.median_s:.2f} ms (median of "
            f"{len(timing.seconds)}), {timing.tokens_per_step:.2f} tokens/step",
        )
    return timings


def warm_up(llm, prompt_ids: list[list[int]], batch: int, k: int) -> None:
    """A few untimed decode steps at the largest batch: one-off work of a fresh engine (kernel
    selection, allocations, compilation of new shapes) stays out of the first measurement."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=4 * (k + 1), temperature=0.0, ignore_eos=True)
    chosen = [{"prompt_token_ids": prompt_ids[i % len(prompt_ids)]} for i in range(batch)]
    llm.generate(chosen, params, use_tqdm=False)


def _measure_acceptance_runs(llm, prompt_ids, plan: TunePlan, label, meter, out) -> None:
    """Greedy acceptance, and sampled at the plan's temperature when it is above 0."""
    temps = [("greedy", 0.0)] + ([("sampled", plan.temperature)] if plan.temperature > 0 else [])
    for name, temperature in temps:
        t0 = time.perf_counter()
        c = measure_acceptance(llm, prompt_ids, temperature, plan)
        out.acceptance[name] = c
        rates = " ".join(f"{x:.2f}" for x in c.per_position_acceptance)
        meter.done(
            "measure",
            time.perf_counter() - t0,
            f"{label}: {name} acceptance per position {rates} ({c.num_drafts} drafting steps)",
        )


# --------------------------------------------------------------------------------------------
# The report (pure: measurements in, schedule and config out).


MEASURING_ONLY = frozenset({"seed", "disable_log_stats", "max_num_seqs", "gpu_memory_utilization"})
"""Engine settings of the measuring engine that serving does not repeat (``--max-num-seqs``
only needs to be at least ``--max-batch``)."""
VLLM_DEFAULTS = {"dtype": "auto", "enforce_eager": False}


def serving_engine_args(engine_kwargs: dict) -> dict:
    """The measuring engine's settings that differ from vLLM's defaults and shape a step (dtype,
    CUDA graphs, context length, caches, kernels): what a server must repeat to serve what tune
    measured."""
    from vllm_nemotron_spec.runs import SMALL_MODEL_DEFAULTS

    settings = {**SMALL_MODEL_DEFAULTS, **engine_kwargs}
    return {
        key: value
        for key, value in sorted(settings.items())
        if value is not None and key not in MEASURING_ONLY and VLLM_DEFAULTS.get(key) != value
    }


def tune_report(plan: TunePlan, m: Measurements, *, prompts, platform: str, vllm_version) -> dict:
    """The JSON-able result: acceptance, step times, expected tokens/s, the chosen schedule and
    the speculative config that serves it."""
    used = "sampled" if "sampled" in m.acceptance else "greedy"
    rates_used = m.acceptance[used].per_position_acceptance
    step_s = {(t.batch, t.k): t.median_s for t in m.timings}
    rates = rate_table(rates_used, step_s)
    choice = choose_schedule(rates)
    ranges = merge_ranges(choice)
    config = speculative_config(plan.method, plan.draft, ranges, plan.speculative_extra)
    no_drafts = {b: r for (b, k), r in rates.items() if k == 0}
    plain = {t.batch: t.batch / t.median_s for t in m.plain}  # tokens/s: one a request a step
    plain_faster = [b for b, k in sorted(choice.items()) if b in plain and plain[b] > rates[(b, k)]]
    if plain and config is not None and len(plain_faster) == len(choice):
        config = None  # plain decoding serves more at every measured batch size
    return {
        "schema": SCHEMA,
        "vllm_version": vllm_version,
        "platform": platform,
        "target": plan.target,
        "draft": plan.draft,
        "method": plan.method,
        "prompts": {"source": prompts.source, "num_prompts": len(prompts.prompts)},
        "temperature": plan.temperature,
        "ks": list(plan.ks),
        "block": plan.block,
        "drafts_only_k": list(m.drafts_only_k),
        "batch_sizes": list(plan.batch_sizes),
        "block_limit": plan.block_limit,
        "acceptance": {name: _acceptance_json(c) for name, c in m.acceptance.items()},
        "acceptance_used": used,
        "expected_accepted": {str(k): round(expected_accepted(rates_used, k), 4) for k in plan.ks},
        "measurements": [
            dict(t.to_json(), expected_tokens_per_s=round(rates[(t.batch, t.k)], 3))
            for t in sorted(m.timings, key=lambda t: (t.batch, t.k))
        ],
        "chosen": [
            {
                "batch": b,
                "k": k,
                "expected_tokens_per_s": round(rates[(b, k)], 3),
                "speedup_vs_k0": (
                    round(rates[(b, k)] / no_drafts[b], 4) if b in no_drafts else None
                ),
                "speedup_vs_plain": round(rates[(b, k)] / plain[b], 4) if b in plain else None,
            }
            for b, k in sorted(choice.items())
        ],
        "plain": [
            dict(
                {key: v for key, v in t.to_json().items() if key != "k"},
                tokens_per_s=round(plain[t.batch], 3),
            )
            for t in sorted(m.plain, key=lambda t: t.batch)
        ]
        or None,
        "plain_faster_at": plain_faster if plain else None,
        "schedule": ranges,
        "speculative_config": config,
        "engine_args": serving_engine_args(plan.engine_kwargs),
        "scattered": [
            [t.batch, t.k] for t in sorted(m.timings, key=lambda t: (t.batch, t.k)) if t.scattered
        ],
        "plain_scattered": sorted(t.batch for t in m.plain if t.scattered),
        "seconds": round(m.seconds, 2),
        "engine_start_s": round(m.engine_start_s, 2),
        "plain_engine_start_s": (
            round(m.plain_start_s, 2) if m.plain_start_s is not None else None
        ),
    }


def _acceptance_json(c: SpecCounters) -> dict:
    return {
        "num_drafts": c.num_drafts,
        "num_draft_tokens": c.num_draft_tokens,
        "num_accepted_tokens": c.num_accepted_tokens,
        "accepted_per_position": list(c.accepted_per_position),
        "per_position_acceptance": [round(x, 6) for x in c.per_position_acceptance],
        "mean_acceptance_length": round(c.mean_acceptance_length or 0.0, 4),
    }
