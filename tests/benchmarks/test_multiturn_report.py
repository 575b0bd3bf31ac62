"""benchmarks/gpu_multiturn.py's report with several servers per row: each server is compared
with the same-numbered server of the other rows, and the rows are summarised across servers."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_multiturn.py"
_spec = importlib.util.spec_from_file_location("gpu_multiturn", _PATH)
mt = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("gpu_multiturn", mt)
_spec.loader.exec_module(mt)


def _run(row, k, tok_s):
    return {
        "name": mt.instance_name(row, k, 3),
        "row": row,
        "status": "ok",
        "concurrency": [{"concurrency": 1, "output_tok_s": tok_s}],
    }


def test_instance_names():
    assert mt.instance_name("plain", 0, 1) == "plain"
    assert mt.instance_name("dspark7-ours", 1, 3) == "dspark7-ours#2"


def test_servers_are_compared_in_turn_and_summarised():
    ours = [500.0, 600.0, 560.0]
    upstream = [400.0, 700.0, 520.0]
    runs = [_run("dspark7-ours", k, t) for k, t in enumerate(ours)]
    runs += [_run("dspark7-upstream", k, t) for k, t in enumerate(upstream)]
    runs.append({"name": "dspark7-ours#4", "row": "dspark7-ours", "status": "skipped: time budget"})
    md = mt.markdown({"setup": {}, "runs": runs})
    lines = md.splitlines()
    # server k of ours against server k of vLLM alone
    assert any(line.startswith("| dspark7-ours#1 | 1 | 500.0 |  | 1.25 |") for line in lines), md
    assert any(line.startswith("| dspark7-ours#2 | 1 | 600.0 |  | 0.86 |") for line in lines), md
    # across servers: medians 560 and 520, ratio 1.08, ranges and counts
    assert "| dspark7-ours | 1 | 560.0 [500-600] | 1.08 | 3 |" in lines, md
    assert "| dspark7-upstream | 1 | 520.0 [400-700] |  | 3 |" in lines, md


def test_one_server_per_row_has_no_summary():
    runs = [
        {
            "name": "dflash5-ours",
            "status": "ok",
            "concurrency": [{"concurrency": 1, "output_tok_s": 2.0}],
        },
        {
            "name": "dflash5-upstream",
            "status": "ok",
            "concurrency": [{"concurrency": 1, "output_tok_s": 1.0}],
        },
    ]
    md = mt.markdown({"setup": {}, "runs": runs})
    assert "Across servers" not in md
    assert any(
        line.startswith("| dflash5-ours | 1 | 2.0 |  | 2.00 |") for line in md.splitlines()
    ), md


def test_reachable_hits_are_the_measured_ones_without_a_backed_off_block():
    """Every H200 row's hits equal whole blocks of the earlier prompts. Lightning widths (8192-token
    prefix, 3 turns of 256 + 128 tokens): plain's 4176-token blocks reach 5 blocks a conversation,
    DSpark 3's 4240, DFlash 5's 4288 and DSpark 7's 4336 reach 4 (DSpark 3's boundary at 8480 lies
    in turn 1's answer, which align mode does not keep, as plain decoding's 624 and 864 in the
    tiny-family rows). A scheduler that backed each hit off by one block would reach fewer."""
    reach = lambda block: mt.reachable_prefix_hits(block, 8192, 3, 256, 128)  # noqa: E731
    assert reach(4176) == 5 * 4176 == 20880  # measured: plain
    assert reach(4240) == 4 * 4240 == 16960  # measured: dspark3 ours and upstream
    assert reach(4288) == 4 * 4288 == 17152  # measured: dflash5 ours and upstream
    assert reach(4336) == 4 * 4336 == 17344  # measured: dspark7 ours and upstream
    # tiny family, 600-token first prompts, 4 turns of +200 user and 48 output tokens; the
    # measured hits of turns 2-4 summed (turn 1: no prefix sent before, so prefix=0 there)
    tiny = lambda block: mt.reachable_prefix_hits(block, 600, 3, 248, 0)  # noqa: E731
    assert tiny(48) == 576 + 816 + 1056  # plain, DFlash, DSpark (bf16 KV), ours and upstream
    assert tiny(80) == 560 + 800 + 1040  # plain, fp8 KV
    assert tiny(96) == 576 + 768 + 1056  # DFlash and DSpark, fp8 KV
    assert mt.reachable_prefix_hits(4096, 8192, 1, 256, 128) == 8192  # the whole prefix
    assert mt.reachable_prefix_hits(8192, 8192, 1, 256, 128) == 8192
    assert mt.reachable_prefix_hits(8193, 8192, 1, 256, 128) == 0


def test_hits_over_reachable_column():
    fp = {"prefix_tokens": 8192, "turns": 3, "user_tokens": 256, "output_tokens": 128}
    run = {
        "name": "dspark7-ours",
        "status": "ok",
        "fingerprint": fp,
        "cache_config": {"block_size": "4336"},
        "concurrency": [
            {"concurrency": 4, "output_tok_s": 1.0, "prefix_cache_hits": 4 * 17344},
            {"concurrency": 16, "output_tok_s": 1.0, "prefix_cache_hits": 16 * 17344 - 16 * 4336},
        ],
    }
    lines = mt.markdown({"setup": {}, "runs": [run]}).splitlines()
    rows = [line.split(" | ") for line in lines if line.startswith("| dspark7-ours |")]
    col = mt.COLUMNS.index("hits / reachable")
    assert [r[col] for r in rows] == ["1.000", "0.750"], rows


def _row(name, tok_s_all, acceptance_all):
    """One server's concurrency-1 row as run_servers stores it: the median repeat by tok/s with every
    repeat's values alongside."""
    reps = sorted(zip(tok_s_all, acceptance_all))
    median_tok_s, median_acceptance = reps[(len(reps) - 1) // 2]
    return {
        "name": name,
        "status": "ok",
        "concurrency": [
            {
                "concurrency": 1,
                "output_tok_s": median_tok_s,
                "output_tok_s_all": list(tok_s_all),
                "mean_acceptance_length": median_acceptance,
                "mean_acceptance_length_all": list(acceptance_all),
            }
        ],
    }


def test_x_upstream_pairs_the_repeats_not_the_medians():
    """The H200 FlashInfer rows (DFlash 5, concurrency 1): both servers drew the same synthetic
    acceptance per repeat, but the median repeat by tok/s was repeat 3 (acceptance 3.57) for ours
    and repeat 2 (3.19) for vLLM alone; the ratio of the medians (1.26) compared unequal work."""
    acceptance = [3.0726, 3.1885, 3.5701]
    ours = _row("dflash5-ours", [102.49, 157.19, 144.93], acceptance)
    upstream = _row("dflash5-upstream", [103.28, 114.67, 124.72], acceptance)
    assert (
        ours["concurrency"][0]["output_tok_s"] / upstream["concurrency"][0]["output_tok_s"] > 1.26
    )
    md = mt.markdown({"setup": {}, "runs": [upstream, ours]})
    # repeat by repeat: 0.99, 1.37, 1.16 -> median 1.16
    assert any(
        line.startswith("| dflash5-ours | 1 | 144.9 [102-157] |  | 1.16 [0.99-1.37] |")
        for line in md.splitlines()
    ), md


def test_x_upstream_falls_back_to_the_medians_when_repeats_do_not_pair():
    ours = _row("dflash5-ours", [100.0, 120.0, 110.0], [3.0, 3.1, 3.2])
    upstream = _row("dflash5-upstream", [90.0, 100.0], [3.0, 3.1])
    assert mt.paired_ratio(ours["concurrency"][0], upstream["concurrency"][0]) == "1.22"
    assert mt.paired_ratio(ours["concurrency"][0], None) == ""


def test_warmup_repeats_run_first_untimed_with_their_own_prompts(monkeypatch):
    """The first repeat in a server is the slow one (kernels compiled on first use): the warm-ups
    run before the timed repeats, on prompts of their own (negative repeat numbers), and stay out
    of the median and the ranges."""
    import argparse

    calls = []

    def fake_repeat(url, model, args, vocab, conc, repeat):
        calls.append(repeat)
        return {"output_tok_s": 10.0 if repeat < 0 else 100.0 + repeat, "tpot_ms": 1.0}

    monkeypatch.setattr(mt, "run_repeat", fake_repeat)
    server = mt.Resident("s", {}, argparse.Namespace(url="http://x"), Path("s.log"), model="m")
    args = argparse.Namespace(warmup_repeats=1, repeats=3)
    row, reps = mt.measure([server], args, 1000, 4, drop=None)["s"]
    assert calls == [-1, 0, 1, 2]
    assert row["output_tok_s"] == 101.0 and row["output_tok_s_all"] == [100.0, 101.0, 102.0]
    assert row["warmup_tok_s"] == [10.0] and len(reps) == 3
    calls.clear()
    mt.measure([server], argparse.Namespace(warmup_repeats=0, repeats=2), 1000, 1, drop=None)
    assert calls == [0, 1]


def test_every_request_carries_a_seed_that_is_the_same_in_every_server(monkeypatch):
    """vLLM 0.33's V2 runner draws synthetic acceptance from the request's seed and the token's
    position, and gives an unseeded request a random seed: without a seed per request two servers
    of one row accept different counts. Each timed request gets its own seed, and a second server
    sent the same repeat gets the same seeds for the same prompts."""
    import argparse

    def one_server():
        sent = []

        def fake_stream(url, model, prompt, max_tokens, timeout, seed=None):
            sent.append((tuple(prompt), max_tokens, seed))
            return {"ids": [7] * max_tokens, "ttft_s": 0.01, "tpot_s": 0.001}

        monkeypatch.setattr(mt, "stream_tokens", fake_stream)
        snap = argparse.Namespace(minus=lambda before: argparse.Namespace(to_json=lambda: {}))
        monkeypatch.setattr(mt._common, "settled_snapshot", lambda url, settle_s=0.0: snap)
        args = argparse.Namespace(
            prefix_tokens=16, turns=3, user_tokens=4, output_tokens=5, request_timeout=1.0
        )
        mt.run_repeat("http://x", "m", args, 1000, 2, 0)
        return sent

    first, second = one_server(), one_server()
    timed = [s for s in first if s[1] == 5]
    assert len(timed) == 6  # 2 conversations x 3 turns
    assert len({seed for _, _, seed in timed}) == 6
    assert all(isinstance(seed, int) for _, _, seed in timed)
    assert sorted(first) == sorted(second)  # the same prompts with the same seeds
    assert mt.request_seed(0, 2, 1, 2) != mt.request_seed(1, 2, 1, 2)


def test_server_files_carry_no_hash_and_keep_what_a_killed_run_measured(monkeypatch, tmp_path):
    """The GPU machine's transfer drops files named with a ``#``: a server's log and result are
    named ``row-k``. Each concurrency is written there as it ends, with a status that is not
    "ok" (a later invocation reruns the server), so a run killed at its time limit keeps them."""
    import argparse

    assert mt.file_stem("dspark7-ours#2") == "dspark7-ours-2"
    assert mt.file_stem("plain") == "plain"

    class Server:
        url, started_s = "http://x", 1.0

        def stop(self):
            pass

    class Killed(BaseException):  # as the command's time limit: not caught as an Exception
        pass

    seen = []

    def fake_repeat(url, model, args, vocab, conc, repeat):
        if conc == 4:
            seen.append(json.loads((tmp_path / "runs" / "dspark7-ours-2.json").read_text()))
            raise Killed
        return {"output_tok_s": 10.0, "ttft_ms": 1.0, "tpot_ms": 1.0, "prefix_cache_hits": 0,
                "prefix_cache_queries": 0, "errors": []}  # fmt: skip

    monkeypatch.setattr(mt, "run_repeat", fake_repeat)
    monkeypatch.setattr(mt, "speculative_config", lambda args, spec, models: None)
    monkeypatch.setattr(mt, "server_args", lambda args, spec: [])
    monkeypatch.setattr(mt, "stream_tokens", lambda *a, **k: {})
    monkeypatch.setattr(mt._common, "launch", lambda *a, **k: Server())
    monkeypatch.setattr(mt._common, "served_model", lambda url: "m")
    monkeypatch.setattr(mt._common, "snapshot", lambda url: argparse.Namespace(cache_config={}))
    monkeypatch.setattr(mt.serve, "wait_ready", lambda server, timeout: None)
    (tmp_path / "runs").mkdir()
    (tmp_path / "logs").mkdir()
    args = argparse.Namespace(
        concurrency=[1, 4], start_timeout=1, request_timeout=1, smoke=False, launcher="auto",
        warmup_repeats=0, repeats=1,
    )  # fmt: skip
    spec = mt.ROWS["dspark7-ours"]
    try:
        mt.run_servers(args, [(spec, "dspark7-ours#2")], {"target": "t"}, 1000, tmp_path)
    except Killed:
        pass
    assert len(seen) == 1
    assert seen[0]["status"] == "partial: concurrency 1 done"
    assert [c["output_tok_s"] for c in seen[0]["concurrency"]] == [10.0]


def test_acceptance_that_differs_from_vllm_alones_server_is_named():
    """Seeded requests draw the same synthetic accept/reject sequence in every server: a plugin
    server whose per-repeat acceptance differs from its vLLM-alone twin's is named in the
    report; equal acceptance adds nothing."""

    def server(row, k, accs):
        return {
            "name": mt.instance_name(row, k, 2),
            "row": row,
            "status": "ok",
            "concurrency": [
                {"concurrency": 1, "output_tok_s": 100.0, "mean_acceptance_length_all": accs}
            ],
        }

    same = [
        server("dspark7-upstream", 0, [3.67, 3.97]),
        server("dspark7-ours", 0, [3.67, 3.97]),
        server("dspark7-upstream", 1, [3.67, 3.97]),
        server("dspark7-ours", 1, [3.67, 3.97]),
    ]
    assert mt.acceptance_differences(same) == []
    differ = same[:3] + [server("dspark7-ours", 1, [3.5, 3.97])]
    lines = mt.acceptance_differences(differ)
    assert len(lines) == 2 and "dspark7-ours#2 at 1: [3.5, 3.97] against [3.67, 3.97]" in lines[1]
    assert "dspark7-ours#1" not in lines[1]
    assert mt.acceptance_differences([server("plain", 0, None)]) == []


def test_seeded_h200_pairs_accept_alike_and_pool_every_repeat_pair():
    """The seeded DFlash 5 pairs measured on the H200: every server drew the same acceptance per
    repeat, and the across-servers ratio pools the six repeat pairs (0.95 at concurrency 1) where
    the ratio of the servers' medians would say 0.96."""
    stored = _PATH.parent / "results" / "2026-12-03-h200-seeded-pairs" / "dflash5.json"
    result = json.loads(stored.read_text())
    assert mt.acceptance_differences(result["runs"]) == []
    lines = mt.markdown(result).splitlines()
    assert "| dflash5-ours | 1 | 541.5 [525-558] | 0.95 [0.86-1.07] | 2 |" in lines
    assert "| dflash5-ours | 4 | 1008.1 [992-1024] | 0.99 [0.93-1.09] | 2 |" in lines


def test_pooled_ratio_needs_every_server_paired():
    """One server whose repeats do not pair (a failed repeat) turns the pooled ratio back into
    the ratio of the servers' medians."""

    def server(row, k, tok_s):
        c = {"concurrency": 1, "output_tok_s": sorted(tok_s)[len(tok_s) // 2]}
        c["output_tok_s_all"] = tok_s
        return {"name": mt.instance_name(row, k, 2), "row": row, "status": "ok", "concurrency": [c]}

    runs = [
        server("dspark7-upstream", 0, [100.0, 100.0, 100.0]),
        server("dspark7-ours", 0, [110.0, 90.0, 100.0]),
        server("dspark7-upstream", 1, [200.0, 200.0, 200.0]),
        server("dspark7-ours", 1, [220.0, 240.0, 200.0]),
    ]
    assert (
        "| dspark7-ours | 1 | 160.0 [100-220] | 1.05 [0.90-1.20] | 2 |"
        in mt.markdown({"setup": {}, "runs": runs}).splitlines()
    )
    runs[3]["concurrency"][0]["output_tok_s_all"] = [220.0, 240.0]
    assert (
        "| dspark7-ours | 1 | 160.0 [100-220] | 1.07 | 2 |"
        in mt.markdown({"setup": {}, "runs": runs}).splitlines()
    )


def test_side_by_side_starts_every_server_first_and_alternates_who_runs_a_repeat_first(
    monkeypatch, tmp_path
):
    """--side-by-side: the set's servers are all launched before the first is waited for, each
    asks for its share of the GPU with a fixed KV cache, every repeat runs on each server in
    turn with the order reversed every other repeat (warm-ups first), and a server that does
    not start is recorded while the others are measured."""
    import argparse

    events = []

    class Server:
        def __init__(self, name, ok=True):
            self.url, self.started_s, self.ok, self.name = f"http://{name}", 1.0, ok, name

        def stop(self):
            events.append(("stop", self.name))

    def launch(target, log, *, args, speculative_config, plugin, launcher):
        name = Path(log).stem
        events.append(("launch", name, tuple(args)))
        return Server(name, ok=name != "dflash5-ours-1")

    def wait_ready(server, timeout):
        events.append(("wait", server.name))
        if not server.ok:
            raise mt.serve.ServerStartError("exited", "no GPU memory left", "CUDA OOM", 1)

    def run_repeat(url, model, args, vocab, conc, repeat):
        events.append(("repeat", url[7:], conc, repeat))
        return {"concurrency": conc, "output_tok_s": 10.0, "ttft_ms": 1.0, "tpot_ms": 1.0,
                "prefix_cache_hits": 0, "prefix_cache_queries": 0, "errors": []}  # fmt: skip

    monkeypatch.setattr(mt, "speculative_config", lambda args, spec, models: None)
    monkeypatch.setattr(mt, "stream_tokens", lambda *a, **k: {})
    monkeypatch.setattr(mt, "run_repeat", run_repeat)
    monkeypatch.setattr(mt._common, "launch", launch)
    monkeypatch.setattr(mt._common, "served_model", lambda url: "m")
    monkeypatch.setattr(mt._common, "snapshot", lambda url: argparse.Namespace(cache_config={}))
    monkeypatch.setattr(mt.serve, "wait_ready", wait_ready)
    (tmp_path / "runs").mkdir()
    (tmp_path / "logs").mkdir()
    args = argparse.Namespace(
        concurrency=[1], repeats=3, warmup_repeats=1, start_timeout=1, request_timeout=1,
        smoke=False, launcher="auto", gpu_memory_utilization=0.9, servers_at_once=3,
        kv_cache_gib=2.0, eager=False, dtype="bfloat16", recipe=False, flashinfer=False,
        target_flashinfer=False, prefix_tokens=8, turns=1, user_tokens=1, output_tokens=1,
        max_model_len=None,
    )  # fmt: skip
    names = ["dspark7-upstream#1", "dspark7-ours#1", "dflash5-ours#1"]
    group = [(mt.ROWS[n.split("#")[0]], n) for n in names]
    entries = mt.run_servers(args, group, {"target": "t"}, 1000, tmp_path)

    kinds = [e[0] for e in events]
    assert kinds[:3] == ["launch"] * 3 and kinds[3:6] == ["wait"] * 3
    for e in events[:3]:
        flags = list(e[2])
        assert flags[flags.index("--gpu-memory-utilization") + 1] == "0.300"
        assert flags[flags.index("--kv-cache-memory-bytes") + 1] == str(2 << 30)
    order = [(e[1], e[3]) for e in events if e[0] == "repeat"]
    a, b = "dspark7-upstream-1", "dspark7-ours-1"
    assert order == [(a, -1), (b, -1), (a, 0), (b, 0), (b, 1), (a, 1), (a, 2), (b, 2)]
    assert [e["status"] for e in entries] == ["ok", "ok", "error"]
    assert "server did not start: no GPU memory left" in entries[2]["error"]
    assert [c["output_tok_s_all"] for c in entries[0]["concurrency"]] == [[10.0] * 3]
    assert {e[1] for e in events if e[0] == "stop"} == {a, b, "dflash5-ours-1"}


def test_side_by_side_rerun_skips_a_kept_set_and_counts_a_warm_set_start(monkeypatch, tmp_path):
    """A rerun whose first set of servers is kept starts only the second set (a kept set is no
    group to run); and a set is not started when the budget cannot hold a warm start of servers
    starting together (150 s on the H200), even when the first set measured nothing."""
    started = []

    def fake_build(models_dir, smoke, depth, dtype):
        target = Path(models_dir) / "target"
        target.mkdir(parents=True, exist_ok=True)
        cfg = {"vocab_size": 1000, "hybrid_override_pattern": "M*", "hidden_size": 8}
        (target / "config.json").write_text(json.dumps(cfg))
        return {"target": str(target)}

    def fake_run_servers(args, group, models, vocab, out):
        started.append([name for _, name in group])
        return [
            {"status": "ok", "run_s": 0.0, "startup_s": 200.0, "concurrency": []} for _ in group
        ]

    monkeypatch.setattr(mt.gl, "build_models", fake_build)
    monkeypatch.setattr(mt, "run_servers", fake_run_servers)
    monkeypatch.setattr(mt._common, "plugin_installed", lambda: True)
    monkeypatch.setattr(mt._common, "versions", lambda: {})
    monkeypatch.setattr(mt._common, "detect_features", lambda: {})
    argv = ["--out", str(tmp_path / "out"), "--models-dir", str(tmp_path / "models"),
            "--runs", "dspark7-upstream,dspark7-ours", "--side-by-side", "--instances", "2",
            "--min-row-s", "1"]  # fmt: skip
    both = [["dspark7-upstream#1", "dspark7-ours#1"], ["dspark7-ours#2", "dspark7-upstream#2"]]

    assert mt.main([*argv, "--budget-s", "500"]) == 0
    assert started == both
    for name in both[1]:  # the second set was killed before it finished
        mt.server_result_path(tmp_path / "out", name).unlink()
    started.clear()
    assert mt.main([*argv, "--budget-s", "500"]) == 0
    assert started == both[1:]

    started.clear()
    assert mt.main([*argv, "--budget-s", "100", "--force"]) == 0
    assert started == both[:1]  # 0.9 x (0 s measuring + 150 s warm start) > 100 s
    result = json.loads((tmp_path / "out" / "multiturn.json").read_text())
    assert [r["status"] for r in result["runs"][-2:]] == ["skipped: time budget"] * 2


def test_side_by_side_h200_pairs_accept_alike_at_every_concurrency():
    """The side-by-side pairs measured on the H200 at concurrency 1, 4 and 16: every server drew
    the same acceptance per repeat, and the plugin's rows pool their repeat pairs."""
    stored = _PATH.parent / "results" / "2026-12-03-h200-side-by-side"
    dflash = json.loads((stored / "dflash5.json").read_text())
    dspark = json.loads((stored / "dspark7.json").read_text())
    for result in (dflash, dspark):
        assert mt.acceptance_differences(result["runs"]) == []
    lines = mt.markdown(dflash).splitlines()
    assert "| dflash5-ours | 16 | 1761.5 [1627-1896] | 1.02 [0.88-1.11] | 2 |" in lines
    assert "| dflash5-ours | 1 | 553.2 [529-578] | 0.97 [0.95-1.08] | 2 |" in lines
    row16 = [
        ln for ln in mt.markdown(dspark).splitlines() if ln.startswith("| dspark7-ours#1 | 16 |")
    ]
    assert row16 and "| 1.07 [0.89-1.11] |" in row16[0]


def test_side_by_side_h200_dspark3_pairs_at_sixteen_on_a_second_machine():
    """DSpark 3 and DSpark 7 served side by side on a second H200: every server drew the same
    acceptance per repeat, and the concurrency-16 rows pool both server pairs' repeats."""
    stored = _PATH.parent / "results" / "2026-12-03-h200-side-by-side" / "second-machine"
    dspark3 = json.loads((stored / "dspark3.json").read_text())
    dspark7 = json.loads((stored / "dspark7.json").read_text())
    for result in (dspark3, dspark7):
        assert mt.acceptance_differences(result["runs"]) == []
        assert [r["status"] for r in result["runs"]] == ["ok"] * 4
    lines = mt.markdown(dspark3).splitlines()
    assert "| dspark3-ours | 16 | 1887.5 [1672-2103] | 1.04 [0.92-1.12] | 2 |" in lines
    assert "| dspark3-ours | 1 | 485.0 [446-524] | 1.01 [0.79-1.23] | 2 |" in lines
    assert (
        "| dspark7-ours | 4 | 1017.4 [991-1044] | 0.96 [0.90-1.08] | 2 |"
        in mt.markdown(dspark7).splitlines()
    )
