"""Multi-turn serving benchmark with long shared prefixes at Nemotron 3.5 Lightning widths: real
``vllm serve`` with the published recipe's cache flags, driven by this script's own streaming
client (token-id prompts, so prefix lengths are exact). Nothing is downloaded.

    python3 benchmarks/gpu_multiturn.py --out DIR --runs plain,dspark3-ours        # H200
    python3 benchmarks/gpu_multiturn.py --out DIR --smoke                           # CPU, tiny

Models: those of ``benchmarks/gpu_lightning.py`` (its ``build_models``: target at Lightning widths
and reduced ``--depth``, random weights via ``--load-format dummy``; DFlash / DSpark drafts in the
official layout and size, random NVFP4 weights, loaded for real), and its synthetic acceptance
(``rejection_sample_method: synthetic`` with NVIDIA's expected lengths: DFlash 3.18 at 5, DSpark
3.69 at 7, DSpark at 3 drafts keeping the 7-draft per-position rate). Rows (``--runs``, the names
of gpu_lightning.py): plain, dspark3-ours, dspark3-upstream, dspark7-ours, dspark7-upstream,
dflash5-ours, dflash5-upstream; "upstream" = the same draft with vLLM alone (``VLLM_PLUGINS=""``),
plain also runs without the plugin. Each row is one server (``--instances K``: K servers a row,
started in turn with the other rows', each compared with the same-numbered server of the others and
summarised across servers: two servers of one row differ more than repeats in one server;
``--side-by-side`` starts the k-th servers of all rows together, each with its share of the GPU
and a fixed KV cache, and runs each repeat on every one in turn), with
``--enable-prefix-caching --mamba-cache-mode align --kv-cache-dtype fp8`` (``--no-recipe`` drops
them), CUDA graphs unless ``--eager``.

Workload per concurrency C (default 1, 4, 16) and repeat: C clients, each a conversation of
``--turns`` turns; every prompt starts with the same ``--prefix-tokens`` random tokens (a fresh
prefix per repeat, sent once before the timed part, as an agent's system prompt and tools
would already be cached), then that conversation's history: ``--user-tokens`` new tokens a turn
and the previous answers (``--output-tokens`` each, greedy, ignore_eos, each request with a
seed of its own, the same in every server: synthetic acceptance then accepts the same drafts
in every row). Defaults: 8192-token
prefix, 3 turns of 256 user + 128 output tokens: ~90% or more of each prompt is reusable.
Reported per row and concurrency (median repeat by output tok/s, range of all repeats, all in
one engine): output tok/s (output tokens / wall time of the repeat); TTFT and TPOT, client side
(streaming: (last - first token time) / (tokens - 1)) and the server's own means from its
/metrics histograms (under load the API server may merge several steps' tokens into one chunk);
mean acceptance length; the prefix-cache hit rate (``vllm:prefix_cache_hits`` /
``vllm:prefix_cache_queries``, tokens, timed part only); preemptions; and any plugin server
whose acceptance differs from its vLLM-alone twin's (the drafts differ). Before the timed repeats
of each concurrency, ``--warmup-repeats`` (default 1) untimed ones with their own prompts: the
first repeat in a server is slower (on the H200 ~30-45% at concurrency 1), and in every pair of
single servers measured so far the later one on the machine was the faster, whichever arm it was
(kernels compiled on first use there and read from the cache by later servers).

Time per row on the H200, depth 30 (estimates: start-up ~100-150 s with CUDA graphs, model
build ~60 s once; each repeat ~5-30 s, most at concurrency 16 and when prefixes miss): ~3-5
minutes with the defaults (3 concurrencies x 3 repeats). Two rows fit one 10-minute command;
so does a side-by-side set of two rows: 5-6 minutes for a draft's first set on a machine, ~2-3
after;
``--budget-s`` (default 540) skips a row that would not fit, and results kept in ``--out`` are
reused (``--force`` reruns). ``--smoke`` (CPU, tiny widths, 2 short turns, concurrency 1 and 2,
1 repeat, no recipe flags: prefix caching's CPU state copies are slow) runs every code path in
~2-3 minutes; on CPU the upstream rows fail (no NVFP4 kernel on CPU) and are recorded.

Writes DIR/multiturn.json, DIR/multiturn.md, DIR/logs/<server>.log, DIR/runs/<server>.json
(<server>: the row, or row-k for its k-th server; a server's measured concurrencies are
written there as each ends, so a killed run keeps them).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
import traceback
import zlib
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common
import gpu_lightning as gl
from _common import http, serve

RUN_NAMES = (
    "plain",
    "dspark3-ours",
    "dspark3-upstream",
    "dspark7-ours",
    "dspark7-upstream",
    "dflash5-ours",
    "dflash5-upstream",
)
ROWS = {r.name: r for r in gl.RUNS}
FLASHINFER_SERVE_ARGS = ("--mamba-backend", "flashinfer")
"""``--flashinfer``: what the published recipe asks of FlashInfer: its Mamba backend, and
(``speculative_config.attention_backend``) FlashInfer attention for the DFlash draft. The target's
attention stays vLLM's choice, as in the recipe (``--target-flashinfer`` moves it too)."""
TARGET_FLASHINFER_ARGS = ("--attention-backend", "FLASHINFER")
SMOKE_MUST = ("plain", "dflash5-ours")  # what must run on CPU (gpu_lightning's smoke set)


# ------------------------------------------------------------------------------------------
# client


def stream_tokens(
    url: str, model: str, prompt: list[int], max_tokens: int, timeout: float, seed: int = 0
) -> dict:
    """One streaming greedy completion; token ids with their arrival times. ``seed``: the
    request's own seed, from which vLLM 0.33's V2 runner draws synthetic acceptance."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "seed": seed,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    t0 = time.perf_counter()
    ids, first, last = [], None, None
    with http.http_request(f"{url}/v1/completions", body, timeout) as resp:
        for chunk in http.sse_chunks(resp):
            if "error" in chunk:
                raise http.CompletionError(str(chunk["error"])[:300])
            got = [t for c in chunk.get("choices") or [] for t in (c.get("token_ids") or [])]
            if got:
                now = time.perf_counter()
                first = first if first is not None else now
                last = now
                ids += got
    if not ids:
        raise http.CompletionError("no tokens streamed")
    return {
        "ids": ids,
        "ttft_s": first - t0,
        "tpot_s": (last - first) / (len(ids) - 1) if len(ids) > 1 else None,
    }


def request_seed(repeat: int, conc: int, client: int, turn: int) -> int:
    """The seed of one request, the same in every server. vLLM 0.33's V2 runner accepts draft i
    of a greedy request in synthetic mode iff ``rand(seed, position) < rate[i]``, with the seed
    drawn at random per request where none is given: unseeded, two servers given the same prompts
    accept different counts (measured acceptance 3.67 and 3.98 at concurrency 1 for the same
    DSpark 7 rates), and tokens/s follows that, not the servers' speed. Seeded, every server
    accepts the same drafts step by step."""
    return zlib.crc32(f"{repeat}/{conc}/{client}/{turn}".encode())


def run_repeat(url: str, model: str, args, vocab: int, conc: int, repeat: int) -> dict:
    """``conc`` conversations at once over a fresh shared prefix; see the module doc."""
    rng = random.Random(1000 * repeat + 7)
    prefix = [rng.randrange(10, vocab) for _ in range(args.prefix_tokens)]
    stream_tokens(url, model, prefix, 1, args.request_timeout)  # the shared prefix, cached once
    before = _common.settled_snapshot(url, settle_s=2.0)
    records, errors = [], []
    lock = threading.Lock()

    def client(c: int):
        crng = random.Random(f"{repeat}-{conc}-{c}")
        history: list[int] = []
        try:
            for turn in range(args.turns):
                history += [crng.randrange(10, vocab) for _ in range(args.user_tokens)]
                rec = stream_tokens(
                    url,
                    model,
                    prefix + history,
                    args.output_tokens,
                    args.request_timeout,
                    seed=request_seed(repeat, conc, c, turn),
                )
                history += rec["ids"]
                with lock:
                    records.append(rec)
        except Exception as exc:  # noqa: BLE001 - recorded
            with lock:
                errors.append(f"{type(exc).__name__}: {exc}"[:400])

    threads = [threading.Thread(target=client, args=(c,)) for c in range(conc)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    delta = _common.settled_snapshot(url).minus(before).to_json()
    n_tokens = sum(len(r["ids"]) for r in records)
    ttfts = [r["ttft_s"] for r in records]
    tpots = [r["tpot_s"] for r in records if r["tpot_s"] is not None]
    return {
        "concurrency": conc,
        "repeat": repeat,
        "wall_s": round(wall, 3),
        "requests": len(records),
        "errors": errors[:5],
        "output_tokens": n_tokens,
        "output_tok_s": n_tokens / wall if wall > 0 and not errors else None,
        "ttft_ms": statistics.mean(ttfts) * 1e3 if ttfts else None,
        "ttft_ms_median": statistics.median(ttfts) * 1e3 if ttfts else None,
        "tpot_ms": statistics.mean(tpots) * 1e3 if tpots else None,
        **delta,
    }


# ------------------------------------------------------------------------------------------
# servers


def measure(servers: list, args, vocab: int, conc: int, drop) -> dict[str, tuple[dict, list]]:
    """One concurrency on every server of ``servers`` (``Resident`` records): ``--warmup-repeats``
    untimed repeats (their own prompts: negative repeat numbers), then ``--repeats`` timed ones,
    each repeat on every server in turn, the order reversed every other timed repeat, so repeat k
    of every server sees the machine at the same moment. A server whose repeat raises goes to
    ``drop(server, exc)`` and out of the rest. Returns, per surviving server's name, the median
    repeat with every repeat's values (``*_all``) and the warm-ups' tok/s, and the timed repeats."""
    warm = {s.name: [] for s in servers}
    reps = {s.name: [] for s in servers}
    plan = [(-1 - w, servers) for w in range(args.warmup_repeats)]
    plan += [(r, servers if r % 2 == 0 else servers[::-1]) for r in range(args.repeats)]
    failed = set()
    for repeat, order in plan:
        for s in order:
            if s.name in failed:
                continue
            try:
                rec = run_repeat(s.server.url, s.model, args, vocab, conc, repeat)
            except Exception as exc:  # noqa: BLE001 - a dead server; the others run
                failed.add(s.name)
                drop(s, exc)
                continue
            (warm if repeat < 0 else reps)[s.name].append(rec)
    return {
        s.name: (summarise(reps[s.name], warm[s.name]), reps[s.name])
        for s in servers
        if s.name not in failed
    }


def summarise(reps: list[dict], warmups: list[dict]) -> dict:
    """The median repeat with every repeat's values (``*_all``) and the warm-ups' tok/s."""
    row = gl.median_repeat(reps)
    for key in (
        "ttft_ms",
        "tpot_ms",
        "prefix_hit_rate",
        "mean_acceptance_length",
        "server_ttft_ms",
        "server_tpot_ms",
    ):
        row[f"{key}_all"] = [r.get(key) for r in reps]
    row["warmup_tok_s"] = [w.get("output_tok_s") for w in warmups]
    return row


def server_args(args, spec) -> list[str]:
    longest = args.prefix_tokens + args.turns * (args.user_tokens + args.output_tokens) + 64
    out = [
        "--load-format",
        "dummy",
        "--skip-tokenizer-init",
        "--seed",
        "0",
        "--max-model-len",
        str(args.max_model_len or longest),
        "--max-num-seqs",
        str(max(args.concurrency)),
    ]
    if args.smoke:
        out += list(serve.CPU_TINY_SERVE_ARGS)
    else:
        share = args.gpu_memory_utilization / args.servers_at_once
        out += ["--dtype", args.dtype, "--gpu-memory-utilization", f"{share:.3f}"]
        if args.servers_at_once > 1:
            # Sized, not profiled: a neighbour starting at the same time would be counted as
            # this server's own non-torch memory.
            out += ["--kv-cache-memory-bytes", str(int(args.kv_cache_gib * (1 << 30)))]
        if args.eager:
            out.append("--enforce-eager")
        else:  # capture only the batch sizes this benchmark runs (faster start-up)
            out += [
                "--compilation-config",
                json.dumps(
                    {"max_cudagraph_capture_size": max(args.concurrency) * (spec.gamma + 1)}
                ),
            ]
    if args.recipe:
        out += list(_common.RECIPE_FLAGS)
    if args.flashinfer:
        out += list(FLASHINFER_SERVE_ARGS)
    if args.target_flashinfer:
        out += list(TARGET_FLASHINFER_ARGS)
    return out


def speculative_config(args, spec, models: dict) -> dict | None:
    if spec.method is None:
        return None
    sc = gl.speculative_config(spec, models, args.smoke)
    sc["draft_load_config"] = {"load_format": "auto"}  # the target is dummy-loaded
    if args.flashinfer and spec.method == "dflash":
        sc["attention_backend"] = "FLASHINFER"
    return sc


def new_entry(args, spec, models: dict) -> dict:
    """A server's result record before it starts: its row, draft and command line."""
    entry = {"name": spec.name, "method": spec.method, "gamma": spec.gamma, "plugin": spec.plugin}
    if spec.method:
        _, alpha, expected = gl.acceptance_rates(spec.method, spec.gamma)
        entry.update(alpha=alpha, expected_acceptance_length=None if args.smoke else expected)
    entry.update(
        server_args=server_args(args, spec),
        speculative_config=speculative_config(args, spec, models),
    )
    return entry


def start_server(args, spec, models: dict, entry: dict, log: Path):
    return _common.launch(
        models["target"],
        log,
        args=entry["server_args"],
        speculative_config=entry["speculative_config"],
        plugin=spec.plugin,
        launcher=args.launcher,
    )


def wait_serving(args, server, entry: dict) -> str:
    """Wait for the server, send one short request, record its start-up time and cache
    config; returns the served model name."""
    serve.wait_ready(server, timeout=args.start_timeout)
    entry["startup_s"] = round(server.started_s, 1)
    model = _common.served_model(server.url)
    stream_tokens(server.url, model, list(range(10, 42)), 8, args.request_timeout)  # warm-up
    entry["cache_config"] = _common.snapshot(server.url).cache_config
    entry["concurrency"] = []
    return model


def record_concurrency(entry: dict, conc: int, row: dict, reps: list[dict], progress: Path) -> None:
    """Add concurrency ``conc``'s summary ``row`` to ``entry`` and to the server's result file
    (so a killed command keeps it); raises when a repeat had failed requests."""
    entry["concurrency"].append(row)
    # What is measured survives a kill (a command's time limit): not "ok", so rerun.
    progress.write_text(json.dumps(dict(entry, status=f"partial: concurrency {conc} done")))
    print(
        f"    {entry['name']} c={conc}: {row['output_tok_s']} tok/s, TTFT {row['ttft_ms']} ms, "
        f"TPOT {row['tpot_ms']} ms, acceptance {row.get('mean_acceptance_length')}, "
        f"prefix hits {row['prefix_cache_hits']}/{row['prefix_cache_queries']}",
        flush=True,
    )
    if any(r["errors"] for r in reps):
        raise http.CompletionError(f"concurrency {conc}: {reps[0]['errors'] or reps[-1]['errors']}")


def record_failure(entry: dict, exc: BaseException) -> None:
    if isinstance(exc, serve.ServerStartError):
        entry.update(
            status="error",
            error=f"server did not start: {_common.start_error(exc)}",
            log_tail=exc.log[-3000:],
        )
    else:
        entry.update(
            status="error",
            error=f"{type(exc).__name__}: {exc}"[:2000],
            traceback=traceback.format_exc()[-3000:],
        )


def finish_entry(entry: dict, log: Path, t0: float) -> dict:
    entry["run_s"] = round(time.time() - t0, 1)
    text = log.read_text(errors="replace") if log.is_file() else ""
    entry["backend_log_lines"] = _common.backend_lines(text)
    return entry


@dataclass
class Resident:
    """One server of a set that is resident on the GPU together."""

    name: str
    entry: dict
    server: object
    log: Path
    model: str | None = None


def run_servers(args, group: list, models: dict, vocab: int, out: Path) -> list[dict]:
    """Start the servers of ``group`` ((spec, name) pairs: one, or with ``--side-by-side`` the
    k-th of every row) at once, so a set starts in the time of its slowest server; measure every
    concurrency on all of them (:func:`measure`), then stop them. One server's failure leaves the
    others measuring."""
    t0 = time.time()
    everyone = []
    for spec, name in group:
        entry = new_entry(args, spec, models)
        log = out / "logs" / f"{file_stem(name)}.log"
        everyone.append(Resident(name, entry, start_server(args, spec, models, entry, log), log))
    live = list(everyone)

    def drop(s: Resident, exc: BaseException) -> None:
        record_failure(s.entry, exc)
        s.server.stop()
        live.remove(s)

    try:
        for s in everyone:
            try:
                s.model = wait_serving(args, s.server, s.entry)
            except Exception as exc:  # noqa: BLE001 - recorded, the others run
                drop(s, exc)
        for conc in args.concurrency:
            measured = measure(list(live), args, vocab, conc, drop)
            for s in list(live):
                row, reps = measured[s.name]
                try:
                    record_concurrency(s.entry, conc, row, reps, server_result_path(out, s.name))
                except Exception as exc:  # noqa: BLE001 - recorded, the others run
                    drop(s, exc)
        for s in live:
            s.entry["status"] = "ok"
    finally:
        _common.stop_all([s.server for s in everyone])
    return [finish_entry(s.entry, s.log, t0) for s in everyone]


# ------------------------------------------------------------------------------------------
# report


def _range(values, fmt="{:.0f}") -> str:
    vals = [v for v in values or [] if v is not None]
    return f" [{fmt.format(min(vals))}-{fmt.format(max(vals))}]" if len(vals) > 1 else ""


def _f(value, fmt: str, missing: str = "") -> str:
    return missing if value is None else fmt.format(value)


COLUMNS = [
    "row",
    "conc",
    "output tok/s [range]",
    "x plain",
    "x upstream",
    "TTFT ms",
    "TPOT ms",
    "server TTFT / TPOT ms",
    "acceptance (measured / expected)",
    "prefix hit rate",
    "hits / reachable",
    "preemptions",
    "startup s",
    "status",
]
NOTE = (
    "Median repeat by output tok/s, [min-max] over the repeats in one engine. x upstream: the "
    'same row with vLLM alone (VLLM_PLUGINS=""); x plain / x upstream are the median [min-max] of '
    "the repeat-by-repeat ratios (repeat k sends the same prompts with the same request seeds to "
    "every server, so synthetic acceptance accepts the same drafts), not a ratio of two medians, "
    "which can pick repeats of different acceptance. Prefix hit rate: prefix-cache hit tokens / "
    "queried tokens over the timed turns (the shared prefix was sent once before them). Hits / "
    "reachable: hit tokens / the most that whole blocks of the row's block size allow (Mamba align "
    "mode reuses whole blocks of earlier prompts; blocks filled while decoding an answer are not "
    "kept, with or without speculation); 1.000 = no block backed off. The block size differs by "
    "row: vLLM sizes it to Mamba's state, whose conv state holds the draft tokens."
)


def reachable_prefix_hits(block: int, prefix: int, turns: int, user: int, output: int) -> int:
    """Most prefix-cache hit tokens one conversation of this workload can get with ``block``-token
    blocks in Mamba align mode: whole blocks of the longest prompt prefilled so far (the shared
    prefix, then each earlier turn's prompt), below the new prompt's last token. Align mode keeps
    a Mamba state only where a prefill chunk ends on the block grid, so blocks completed while
    decoding an answer are not reusable: the same for plain and speculative decoding (every H200
    and tiny-family row measured so far matches this exactly)."""
    cached, hits = prefix, 0
    for t in range(1, turns + 1):
        prompt = prefix + t * user + (t - 1) * output
        hits += min(cached, prompt - 1) // block * block
        cached = max(cached, prompt)
    return hits


def _hits_over_reachable(run: dict, c: dict) -> float | None:
    fp = run.get("fingerprint") or {}
    block = (run.get("cache_config") or {}).get("block_size")
    hits = c.get("prefix_cache_hits")
    keys = ("prefix_tokens", "turns", "user_tokens", "output_tokens")
    if block is None or hits is None or not all(k in fp for k in keys):
        return None
    reach = c["concurrency"] * reachable_prefix_hits(int(block), *(fp[k] for k in keys))
    return hits / reach if reach else None


def instance_name(row: str, instance: int, instances: int) -> str:
    """``row`` with one server, else ``row#k`` (k from 1) for its k-th server."""
    return row if instances == 1 else f"{row}#{instance + 1}"


def file_stem(name: str) -> str:
    """A server's name as its files are named (``row-k``, not ``row#k``): the GPU machine's
    transfer brings back no file whose name holds a ``#``."""
    return name.replace("#", "-")


def server_result_path(out: Path, name: str) -> Path:
    """Where a server's result is written as each concurrency ends, and read back by a later
    invocation with the same ``--out``."""
    return out / "runs" / f"{file_stem(name)}.json"


def _upstream_row(row: str) -> str | None:
    """The vLLM-alone row a plugin row is compared with (None for the others)."""
    return row.replace("-ours", "-upstream") if row.endswith("-ours") else None


def _same_numbered(by_name: dict, run: dict, other_row: str | None) -> dict | None:
    """The server of ``other_row`` with ``run``'s number (``#k``; none with one server a row):
    the one ``run`` is compared with."""
    if other_row is None:
        return None
    row = run.get("row", run["name"])
    return by_name.get(other_row + run["name"][len(row) :])


def _conc_row(run: dict | None, conc: int) -> dict | None:
    for c in (run or {}).get("concurrency") or []:
        if c["concurrency"] == conc:
            return c
    return None


def _tok_s(run: dict | None, conc: int) -> float | None:
    return (_conc_row(run, conc) or {}).get("output_tok_s")


def _repeat_ratios(row: dict, base: dict) -> list[float] | None:
    """``row`` over ``base`` in tokens/s, repeat k against repeat k (both servers ran the same
    workload with the same seeds), or None when the repeats do not pair up (a different repeat
    count, a failed repeat)."""
    a, b = row.get("output_tok_s_all") or [], base.get("output_tok_s_all") or []
    if len(a) != len(b) or len(a) < 2 or not all(a) or not all(b):
        return None
    return [x / y for x, y in zip(a, b)]


def _median_range(ratios: list[float]) -> str:
    return f"{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"


def paired_ratio(row: dict, base: dict | None) -> str:
    """``row`` over ``base`` in tokens/s: the median [min-max] of the repeat-by-repeat ratios, or
    the ratio of the medians when the repeats do not pair up."""
    if not base or not row.get("output_tok_s") or not base.get("output_tok_s"):
        return ""
    ratios = _repeat_ratios(row, base)
    if ratios is None:
        return f"{row['output_tok_s'] / base['output_tok_s']:.2f}"
    return _median_range(ratios)


def _pooled_ratio(runs: list[dict], by_name: dict, conc: int) -> str | None:
    """A plugin row's servers over their same-numbered vLLM-alone servers at ``conc``: the
    median [min-max] of every repeat pair of every server, or None unless every server pairs."""
    pooled = []
    for r in runs:
        mine = _conc_row(r, conc)
        twin = _conc_row(_same_numbered(by_name, r, _upstream_row(r.get("row", r["name"]))), conc)
        ratios = _repeat_ratios(mine, twin) if mine and twin else None
        if ratios is None:
            return None
        pooled += ratios
    return _median_range(pooled) if pooled else None


def across_instances(runs: list[dict]) -> list[str]:
    """Markdown lines: per row with several servers and per concurrency, the median of the
    servers' median tok/s with their range, and the plugin's over vLLM alone's: the median
    [min-max] of all its servers' repeat pairs, else the ratio of the two medians."""
    by_name = {r["name"]: r for r in runs}
    by_row: dict[str, list[dict]] = {}
    for r in runs:
        if r.get("concurrency"):
            by_row.setdefault(r.get("row", r["name"]), []).append(r)
    medians: dict[tuple[str, int], tuple[float, list[float]]] = {}
    for row, servers in by_row.items():
        for conc in sorted({c["concurrency"] for r in servers for c in r["concurrency"]}):
            vals = [v for v in (_tok_s(r, conc) for r in servers) if v is not None]
            if len(vals) > 1:
                medians[row, conc] = (statistics.median(vals), vals)
    if not medians:
        return []
    lines = [
        "",
        "Across servers (median of the servers' medians [min-max], servers; x upstream: the "
        "median [min-max] of every repeat pair of every server, as in the rows above):",
        "",
        "| row | conc | output tok/s | x upstream | servers |",
        "|---|---|---|---|---|",
    ]
    for (row, conc), (med, vals) in medians.items():
        up = medians.get((_upstream_row(row), conc))
        ratio = ""
        if up:
            ratio = _pooled_ratio(by_row[row], by_name, conc) or f"{med / up[0]:.2f}"
        lines.append(
            f"| {row} | {conc} | {med:.1f} [{min(vals):.0f}-{max(vals):.0f}] | {ratio} | {len(vals)} |"
        )
    return lines


def acceptance_differences(runs: list[dict]) -> list[str]:
    """Markdown lines naming each plugin server whose acceptance, repeat by repeat, differs from
    the same-numbered vLLM-alone server's. With seeded requests synthetic acceptance draws the
    same accept/reject sequence in both, so a difference means the drafts differ (a placeholder
    draft is rejected whatever the draw)."""
    by_name = {r["name"]: r for r in runs}
    found = []
    for r in runs:
        twin = _same_numbered(by_name, r, _upstream_row(r.get("row", r["name"])))
        for c in r.get("concurrency") or []:
            a = c.get("mean_acceptance_length_all")
            b = (_conc_row(twin, c["concurrency"]) or {}).get("mean_acceptance_length_all")
            if a and b and a != b:
                found.append(f"{r['name']} at {c['concurrency']}: {a} against {b}")
    if not found:
        return []
    return [
        "",
        "Acceptance per repeat differs from vLLM alone's server (equal with seeded requests "
        "unless the drafts differ): " + "; ".join(found) + ".",
    ]


def markdown(result: dict) -> str:
    rows = []
    by_name = {r["name"]: r for r in result["runs"]}

    for r in result["runs"]:
        if not r.get("concurrency"):
            err = str(r.get("error") or r.get("status"))[:200].replace("|", "/").replace("\n", " ")
            rows.append(f"| {r['name']} | | | | | | | | | | | | {r.get('startup_s', '')} | {err} |")
            continue
        row = r.get("row", r["name"])
        for c in r["concurrency"]:
            t = c.get("output_tok_s")
            base = _conc_row(
                _same_numbered(by_name, r, "plain" if row != "plain" else None), c["concurrency"]
            )
            up = _conc_row(_same_numbered(by_name, r, _upstream_row(row)), c["concurrency"])
            acc = c.get("mean_acceptance_length")
            exp = r.get("expected_acceptance_length")
            hit = c.get("prefix_hit_rate")
            rows.append(
                f"| {r['name']} | {c['concurrency']} | {_f(t, '{:.1f}')}{_range(c.get('output_tok_s_all'))} | "
                f"{paired_ratio(c, base)} | {paired_ratio(c, up)} | "
                f"{_f(c.get('ttft_ms'), '{:.1f}')}{_range(c.get('ttft_ms_all'))} | "
                f"{_f(c.get('tpot_ms'), '{:.2f}')}{_range(c.get('tpot_ms_all'), '{:.2f}')} | "
                f"{_f(c.get('server_ttft_ms'), '{:.1f}')} / {_f(c.get('server_tpot_ms'), '{:.2f}')} | "
                f"{_f(acc, '{:.2f}', '-')}{_f(exp, ' / {:.2f}')} | "
                f"{_f(hit, '{:.3f}', '-')}{_range(c.get('prefix_hit_rate_all'), '{:.3f}')} | "
                f"{_f(_hits_over_reachable(r, c), '{:.3f}', '-')} | "
                f"{c.get('preemptions', '')} | {r.get('startup_s', '')} | {r['status']} |"
            )
    title = "Multi-turn serving benchmark (vllm serve, recipe cache flags, Lightning widths)"
    note = "\n".join(
        [NOTE, *across_instances(result["runs"]), *acceptance_differences(result["runs"])]
    )
    return _common.results_markdown(title, result["setup"], COLUMNS, rows, note)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", required=True)
    p.add_argument(
        "--runs",
        default=None,
        help=f"comma-separated subset of {list(RUN_NAMES)} (default: all, "
        "as the budget allows; ~3-5 minutes each on the H200)",
    )
    p.add_argument("--smoke", action="store_true", help="CPU: tiny widths, every code path")
    p.add_argument(
        "--depth", type=int, default=30, help="target blocks (>= 29; 52 = the real model)"
    )
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=None)
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="per concurrency, in one engine (default 3; smoke 1)",
    )
    p.add_argument(
        "--warmup-repeats",
        type=int,
        default=None,
        help="untimed repeats per concurrency before the timed ones (default 1; smoke 0): the "
        "first repeat in a server runs Triton kernels compiled for its shapes on first use, "
        "which later servers on the machine read from the cache",
    )
    p.add_argument(
        "--prefix-tokens", type=int, default=None, help="shared prefix (default 8192; smoke 256)"
    )
    p.add_argument(
        "--turns", type=int, default=None, help="turns per conversation (default 3; smoke 2)"
    )
    p.add_argument(
        "--user-tokens", type=int, default=None, help="new tokens a turn (default 256; smoke 32)"
    )
    p.add_argument(
        "--output-tokens", type=int, default=None, help="answer tokens (default 128; smoke 16)"
    )
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument(
        "--recipe",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="--enable-prefix-caching --mamba-cache-mode align --kv-cache-dtype fp8 (default: on; "
        "off with --smoke)",
    )
    p.add_argument(
        "--flashinfer",
        action="store_true",
        help="add "
        + " ".join(FLASHINFER_SERVE_ARGS)
        + " (and FLASHINFER draft attention for DFlash): the recipe's FlashInfer options",
    )
    p.add_argument(
        "--target-flashinfer",
        action="store_true",
        help="also " + " ".join(TARGET_FLASHINFER_ARGS) + " for the target (beyond the recipe; on "
        "Hopper vLLM then captures piecewise CUDA graphs only under speculative decoding)",
    )
    p.add_argument(
        "--instances",
        type=int,
        default=1,
        help="servers per row, started in turn with the other rows' (default 1): tok/s differs "
        "more between two servers of the same row than between repeats in one",
    )
    p.add_argument(
        "--side-by-side",
        action="store_true",
        help="start the k-th server of every row together on the one GPU (each with "
        "--gpu-memory-utilization / servers and --kv-cache-memory-bytes --kv-cache-gib) and run "
        "each repeat on every server in turn, reversing the order every other repeat: a set "
        "starts in the time of its slowest server, not the sum, and repeat k of every server "
        "sees the machine at the same moment",
    )
    p.add_argument(
        "--kv-cache-gib",
        type=float,
        default=16.0,
        help="KV cache per server with --side-by-side (default 16: ~550K tokens at Lightning "
        "widths with fp8 KV, ~2.5x what 16 clients of the default workload hold)",
    )
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--eager", action="store_true", help="--enforce-eager (no CUDA graphs)")
    p.add_argument("--launcher", choices=("auto", "vllm", "passthrough"), default="auto")
    p.add_argument(
        "--start-timeout",
        type=float,
        default=None,
        help="seconds a server may take to start (default 420; 900 with --flashinfer or "
        "--target-flashinfer: without flashinfer-cubin / flashinfer-jit-cache FlashInfer compiles "
        "its kernels on first use, and a Lightning-width server was still starting after 400 s)",
    )
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--budget-s", type=float, default=540.0, help="start no row after this")
    p.add_argument("--min-row-s", type=float, default=150.0, help="time a row needs at least")
    p.add_argument(
        "--force", action="store_true", help="rerun rows that already succeeded in --out"
    )
    p.add_argument(
        "--models-dir",
        default=os.environ.get("LIGHTNING_MODELS_DIR", "/tmp/vllm-nemotron-lightning"),
    )
    args = p.parse_args(argv)
    smoke_defaults = {
        "concurrency": [1, 2],
        "repeats": 1,
        "warmup_repeats": 0,
        "prefix_tokens": 256,
        "turns": 2,
        "user_tokens": 32,
        "output_tokens": 16,
        "recipe": False,
    }
    full_defaults = {
        "concurrency": [1, 4, 16],
        "repeats": 3,
        "warmup_repeats": 1,
        "prefix_tokens": 8192,
        "turns": 3,
        "user_tokens": 256,
        "output_tokens": 128,
        "recipe": True,
    }
    if args.start_timeout is None:
        args.start_timeout = 900.0 if (args.flashinfer or args.target_flashinfer) else 420.0
    for key, value in (smoke_defaults if args.smoke else full_defaults).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    names = args.runs.split(",") if args.runs else list(RUN_NAMES)
    unknown = [n for n in names if n not in RUN_NAMES]
    if unknown:
        raise SystemExit(f"unknown runs {unknown}; choose from {list(RUN_NAMES)}")
    args.servers_at_once = len(names) if args.side_by_side else 1

    t_start = time.time()
    out = Path(args.out)
    for sub in ("logs", "runs"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    models_dir = Path(args.models_dir) / ("smoke" if args.smoke else f"depth{args.depth}")
    models = gl.build_models(
        models_dir, args.smoke, args.depth, "float32" if args.smoke else args.dtype
    )
    target_cfg = json.loads((Path(models["target"]) / "config.json").read_text())
    vocab = target_cfg["vocab_size"]
    have_plugin = _common.plugin_installed()
    result = {
        "setup": {
            "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
            "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
            **_common.versions(),
            "features": _common.detect_features(),
            "target": f"NemotronH {target_cfg['hybrid_override_pattern']} ({len(target_cfg['hybrid_override_pattern'])} "
            f"blocks), hidden {target_cfg['hidden_size']}, vocab {vocab}, random weights (load_format dummy)",
            "drafts": "official layout and size, random NVFP4 W4A16 weights (gpu_lightning.build_models)",
            "workload": f"{args.prefix_tokens}-token shared prefix, {args.turns} turns of {args.user_tokens} user + "
            f"{args.output_tokens} output tokens, concurrency {args.concurrency}, {args.repeats} repeats"
            f", {args.instances} server(s) per row"
            + (", each row's k-th servers side by side on the GPU" if args.side_by_side else ""),
            "cache_flags": " ".join(_common.RECIPE_FLAGS) if args.recipe else "engine defaults",
            "flashinfer": " ".join(
                [
                    *(FLASHINFER_SERVE_ARGS if args.flashinfer else ()),
                    *(TARGET_FLASHINFER_ARGS if args.target_flashinfer else ()),
                ]
            )
            or "no",
            "acceptance": "standard rejection sampling (CPU)"
            if args.smoke
            else "synthetic: position i accepted with rate a^i, 1 + sum a^i = NVIDIA's expected "
            "length; every request seeded (request_seed), the same in every server",
            "cuda_graphs": not (args.eager or args.smoke),
            "plugin_entry_point_installed": have_plugin,
        },
        "runs": [],
    }

    def save():
        _common.write_results(out, "multiturn", result, markdown(result))

    fingerprint = {
        k: getattr(args, k)
        for k in (
            "smoke",
            "depth",
            "concurrency",
            "repeats",
            "warmup_repeats",
            "prefix_tokens",
            "turns",
            "user_tokens",
            "output_tokens",
            "recipe",
            "flashinfer",
            "target_flashinfer",
            "instances",
            "side_by_side",
            "dtype",
            "eager",
        )
    }
    # A warm start on the H200: later single servers 69-91 s; a side-by-side set 67-150 s (its
    # servers start together, so they compete for the CPUs while they compile and capture).
    warm_start_s = 150.0 if args.side_by_side else 90.0
    budget = _common.RunBudget(
        args.budget_s, args.min_row_s, started=t_start, factor=0.9, warm_start_s=warm_start_s
    )

    def stamp() -> str:
        return f"[{time.time() - t_start:5.0f}s]"

    def not_to_run(row: str, name: str) -> bool:
        """Records a server that is kept from an earlier invocation or cannot run; True then."""
        kept = server_result_path(out, name)
        previous = json.loads(kept.read_text()) if kept.is_file() else None
        if (
            previous
            and previous.get("status") == "ok"
            and previous.get("fingerprint") == fingerprint
            and not args.force
        ):
            print(f"{stamp()} {name}: kept from an earlier invocation", flush=True)
            result["runs"].append(dict(previous, kept=True))
        elif ROWS[row].plugin and not have_plugin:
            result["runs"].append(
                {
                    "name": name,
                    "row": row,
                    "status": "error",
                    "error": "plugin entry point 'nemotron_spec' "
                    "not installed: pip install --no-deps -e .",
                }
            )
        else:
            return False
        save()
        return True

    def fits(group: list[tuple[str, str]]) -> bool:
        """Whether a set of (row, server name) fits the budget; records it as skipped if not."""
        remaining = budget.remaining()
        need = max(budget.need(row) for row, _ in group)  # a row's servers share caches
        if remaining >= need or args.smoke:
            return True
        for row, name in group:
            print(
                f"{stamp()} {name}: skipped (budget: {remaining:.0f} s left, ~{need:.0f} s needed)"
            )
            result["runs"].append({"name": name, "row": row, "status": "skipped: time budget"})
        save()
        return False

    def done(row: str, name: str, entry: dict, took: float) -> None:
        entry.update(name=name, row=row, fingerprint=fingerprint)
        budget.record(row, took, entry.get("startup_s"))
        server_result_path(out, name).write_text(json.dumps(entry, indent=1))
        result["runs"].append(entry)
        save()
        print(
            f"{stamp()} {name}: {entry['status']} in {entry['run_s']} s "
            f"{entry.get('error', '')[:300]}",
            flush=True,
        )

    # Servers of different rows alternate (A#1, B#1, A#2, B#2, ...), so a drift of the machine
    # over the run does not fall on one row; side by side, set k starts every row's k-th server
    # together (in reversed row order for odd k: which one runs a repeat first alternates too).
    for instance in range(args.instances):
        rows = names if not (args.side_by_side and instance % 2) else names[::-1]
        servers = [(row, instance_name(row, instance, args.instances)) for row in rows]
        todo = [(row, name) for row, name in servers if not not_to_run(row, name)]
        sets = [todo] if args.side_by_side else [[t] for t in todo]
        for group in [g for g in sets if g]:  # a set whose servers are all kept runs nothing
            if not fits(group):
                continue
            together = " side by side" if len(group) > 1 else ""
            print(f"{stamp()} {', '.join(n for _, n in group)}: starting{together}", flush=True)
            t0 = time.time()
            specs = [(ROWS[row], name) for row, name in group]
            for (row, name), entry in zip(group, run_servers(args, specs, models, vocab, out)):
                done(row, name, entry, time.time() - t0)
    result["wall_s"] = round(time.time() - t_start, 1)
    save()
    print((out / "multiturn.md").read_text())
    must = SMOKE_MUST if args.smoke else names
    ok = all(
        str(r.get("status", "")).startswith(("ok", "skipped"))
        for r in result["runs"]
        if r.get("row", r["name"]) in must
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
