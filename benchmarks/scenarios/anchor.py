"""anchor: NVIDIA's published H200 operating point, replayed on the Lightning NVFP4 target.

NVIDIA's figure for this model (vLLM, an agentic trace of ~64K-token inputs and ~400-token
outputs with ~90% prefix reuse, synthetic acceptance): DSpark 7 at acceptance 3.69, concurrency
20: 2,194 output tok/s per GPU; DFlash 5 at 3.18 (concurrency 16 in NVIDIA's table): 1,744. Kernel
time does not depend on the values, so the same shape on random weights is comparable.

The workload (``harness/served.py``): ``--concurrency`` sessions at once; each session's context
is ``--input-len`` x ``--reuse`` tokens (``--shared-prefix`` of them common to all sessions),
sent once untimed (what a running agent already has cached), then ``--turns`` timed turns of
``--input-len`` x (1 - ``--reuse``) new tokens and ``--output-len`` generated ones (greedy,
ignore_eos, seeded), each answer joining the context. The first timed prompt is ``--input-len``
tokens of which ``--reuse`` were cached; later ones grow by a turn. Served with the recipe's
prefix caching in Mamba align mode and fp8 KV cache, NVIDIA's ``--moe-backend marlin``; one
server at a time by default (long contexts need the KV cache vLLM profiles). Reported per server:
output tok/s per GPU (output tokens of the timed turns over their wall time), beside NVIDIA's
figure for its draft and vLLM alone's; acceptance, prefix hit rate, prompt length, TTFT, TPOT.
"""

from __future__ import annotations

import argparse

from benchmarks.harness import arms, report, served
from benchmarks.harness.common import add_common_arguments
from benchmarks.scenarios import serving

NAME = "anchor"
TITLE = "anchor: NVIDIA's H200 operating point on the Lightning NVFP4 target"
NVIDIA = {"dspark7": (2194, 20, 3.69), "dflash5": (1744, 16, 3.18)}
"""Published output tok/s per GPU on the H200, at (concurrency, acceptance length)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common_arguments(p)
    served.add_server_arguments(p, kv_cache_gib=40.0)
    p.add_argument("--arms", default=None,
                   help="comma-separated rows (default dspark7,dflash5: vLLM alone and the "
                   "plugin each; smoke dspark7-plugin)")  # fmt: skip
    p.add_argument("--concurrency", default=None, help="sessions at once (default 20)")
    p.add_argument("--input-len", type=int, default=None,
                   help="prompt tokens of a session's first timed turn (default 65536)")  # fmt: skip
    p.add_argument("--reuse", type=float, default=0.9,
                   help="share of that prompt already cached (default 0.9)")  # fmt: skip
    p.add_argument("--shared-prefix", type=int, default=0,
                   help="of the cached part, tokens common to every session (default 0)")  # fmt: skip
    p.add_argument("--output-len", type=int, default=None, help="tokens a turn (default 400)")
    p.add_argument("--turns", type=int, default=None, help="timed turns a session (default 2)")


def defaults(args) -> None:
    full = {"arms": "dspark7,dflash5", "concurrency": "20", "input_len": 65536, "output_len": 400,
            "turns": 2, "repeats": 2, "warmup_repeats": 0, "recipe": True}  # fmt: skip
    smoke = {"arms": "dspark7-plugin", "concurrency": "2", "input_len": 256, "output_len": 8,
             "turns": 2, "repeats": 1, "warmup_repeats": 0, "recipe": False}  # fmt: skip
    for key, value in (smoke if args.smoke else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.concurrency = [int(c) for c in str(args.concurrency).split(",")]
    if args.side_by_side is None:
        args.side_by_side = False


def workload(args) -> served.Sessions:
    if not 0.0 <= args.reuse < 1.0:
        raise SystemExit(f"--reuse must be in [0, 1), got {args.reuse}")
    user = max(1, round(args.input_len * (1.0 - args.reuse)))
    cached = args.input_len - user
    if args.shared_prefix > cached:
        raise SystemExit(f"--shared-prefix {args.shared_prefix} is more than the cached part "
                         f"of the prompt ({cached} tokens)")  # fmt: skip
    return served.Sessions(args.shared_prefix, cached - args.shared_prefix, user,
                           args.output_len, args.turns)  # fmt: skip


def run(args) -> int:
    defaults(args)
    return serving.run_served(NAME, TITLE, args, workload(args), tables)


COLUMNS = ["server", "conc", "output tok/s per GPU [range]", "NVIDIA (conc, acceptance)",
           "x NVIDIA", "x alone", "acceptance", "prefix hit rate", "mean prompt tokens",
           "s a turn", "TTFT ms", "TPOT ms", "server queue / prefill / decode ms", "preemptions",
           "startup s", "status"]  # fmt: skip


def tables(result: dict, args, work: served.Sessions) -> list:
    servers = result["servers"]
    t = report.Table("Output tokens/s per GPU beside NVIDIA's", list(COLUMNS),
                     setup=serving.setup_lines(result, args, work), notes=[NOTE])  # fmt: skip
    for name, entry in servers.items():
        row = entry.get("row", name.split("#")[0])
        published = NVIDIA.get(row.split("-")[0])
        nvidia = f"{published[0]} ({published[1]}, {published[2]})" if published else ""
        rows = entry.get("concurrency") or []
        for conc, status in served.status_rows(entry):
            t.add(name, conc, "", nvidia, "", "", "", "", "", "", "", "", "", "",
                  entry.get("startup_s"), status[:200])  # fmt: skip
        for c in rows:
            alone = serving.conc_row(serving.twin(servers, name, arms.alone_twin(row)),
                                     c["concurrency"])  # fmt: skip
            tok_s = c.get("output_tok_s")
            t.add(
                name, c["concurrency"], report.median_with_range(c.get("output_tok_s_all"), "{:.0f}"),
                nvidia, report.fmt(tok_s / published[0] if tok_s and published else None),
                report.ratio_cell(c.get("output_tok_s_all"), (alone or {}).get("output_tok_s_all"))
                if alone else "",
                report.fmt(c.get("mean_acceptance_length"), "{:.2f}", "-"),
                report.fmt(c.get("prefix_hit_rate"), "{:.3f}", "-"),
                report.fmt(c.get("mean_prompt_tokens"), "{:.0f}"),
                report.fmt(turn_s(c, work)), report.fmt(c.get("ttft_ms"), "{:.0f}"),
                report.fmt(c.get("tpot_ms")), request_split(c), c.get("preemptions"),
                entry.get("startup_s"), str(entry.get("status"))[:120],
            )  # fmt: skip
    return [t, *served.profile_tables(servers)]


def turn_s(c: dict, work: served.Sessions) -> float | None:
    """Median seconds the timed turns of one repeat took, a turn (all sessions' at once)."""
    walls = [r.get("wall_s") for r in c.get("repeats_detail") or [] if r.get("wall_s")]
    return report.median(walls) / work.turns if walls else None


def request_split(c: dict) -> str:
    """The server's mean per request: waiting to be scheduled / prefill to the first token /
    decode (vLLM's request_{queue,prefill,decode}_time histograms)."""
    keys = ("server_queue_ms", "server_prefill_ms", "server_decode_ms")
    if all(c.get(k) is None for k in keys):
        return ""
    return " / ".join(report.fmt(c.get(k), "{:.0f}", "-") for k in keys)


NOTE = (
    "One GPU per server: output tok/s per GPU is the timed turns' output tokens over their wall "
    "time (the untimed first send of each session's cached context excluded, the new tokens' "
    "prefill included). NVIDIA: its published H200 figure for the draft, at its concurrency and "
    "acceptance length; x NVIDIA: this server's median over that figure. x alone: over vLLM "
    "alone's server with the same draft, repeat k against repeat k (same prompts and seeds). "
    "s a turn: the median repeat's timed wall over its turns. Server queue / prefill / decode: "
    "vLLM's mean per request of the time waiting to be scheduled, from scheduled to the first "
    "token, and from the first token to the last."
)
