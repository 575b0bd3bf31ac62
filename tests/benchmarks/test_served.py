"""benchmarks/harness/served.py and the served scenarios' tables, on inputs built here: the
/metrics deltas, the prefix hits whole blocks allow, seeded requests, the order repeats run in,
and the plugin / vLLM-alone pairing by instance and repeat."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from benchmarks.harness import served
from benchmarks.scenarios import anchor, serving

METRICS = """\
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{{engine="0"}} {queries}
vllm:prefix_cache_hits_total{{engine="0"}} {hits}
vllm:num_preemptions_total{{engine="0"}} 0
vllm:generation_tokens_total{{engine="0"}} {gen}
vllm:time_to_first_token_seconds_sum{{engine="0"}} {ttft_sum}
vllm:time_to_first_token_seconds_count{{engine="0"}} {ttft_count}
vllm:time_to_first_token_seconds_created{{engine="0"}} 12345
vllm:request_prefill_time_seconds_sum{{engine="0"}} {prefill_sum}
vllm:request_prefill_time_seconds_count{{engine="0"}} {ttft_count}
vllm:request_decode_time_seconds_sum{{engine="0"}} {decode_sum}
vllm:request_decode_time_seconds_count{{engine="0"}} {ttft_count}
vllm:cache_config_info{{block_size="4336",cache_dtype="fp8",engine="0",mamba_cache_mode="align"}} 1
vllm:spec_decode_num_drafts_total{{engine="0"}} {drafts}
vllm:spec_decode_num_draft_tokens_total{{engine="0"}} {draft_tokens}
vllm:spec_decode_num_accepted_tokens_total{{engine="0"}} {accepted}
"""


def metrics(**values):
    base = dict(queries=0, hits=0, gen=0, ttft_sum=0.0, ttft_count=0, prefill_sum=0.0,
                decode_sum=0.0, drafts=0, draft_tokens=0, accepted=0)  # fmt: skip
    return served.parse_snapshot(METRICS.format(**{**base, **values}))


def test_snapshot_deltas():
    before = metrics(queries=100, hits=40, gen=10, ttft_sum=1.0, ttft_count=2, prefill_sum=0.5,
                     decode_sum=3.0, drafts=5, draft_tokens=15, accepted=5)  # fmt: skip
    after = metrics(queries=300, hits=190, gen=70, ttft_sum=1.5, ttft_count=4, prefill_sum=0.9,
                    decode_sum=4.0, drafts=25, draft_tokens=75, accepted=45)  # fmt: skip
    d = after.minus(before)
    assert (d["prefix_queries"], d["prefix_hits"], d["prefix_hit_rate"]) == (200, 150, 0.75)
    assert d["generation_tokens"] == 60 and d["server_ttft_ms"] == 250.0
    # the request time split: the two new requests' means; queue time absent from this server
    assert d["server_prefill_ms"] == 200.0 and d["server_decode_ms"] == 500.0
    assert d["server_queue_ms"] is None
    assert d["mean_acceptance_length"] == 1 + 40 / 20 and d["num_drafts"] == 20
    assert after.cache_config == {"block_size": "4336", "cache_dtype": "fp8",
                                  "mamba_cache_mode": "align"}  # fmt: skip


def sessions(shared, turns, user, output, history=0):
    return served.Sessions(shared, history, user, output, turns)


def test_reachable_hits_are_whole_blocks_of_earlier_prompts():
    """8192-token shared prefix, 3 turns of 256 + 128: 4176-token blocks reach 5 a conversation,
    4240 (its boundary at 8480 lies in turn 1's answer, which align mode does not keep) 4."""
    reach = lambda block: served.reachable_prefix_hits(block, sessions(8192, 3, 256, 128))  # noqa: E731
    assert reach(4176) == 5 * 4176
    assert reach(4240) == 4 * 4240 and reach(4288) == 4 * 4288
    assert reach(4336) == 4 * 4336
    assert served.reachable_prefix_hits(4096, sessions(8192, 1, 256, 128)) == 8192
    assert served.reachable_prefix_hits(8193, sessions(8192, 1, 256, 128)) == 0
    # a session's own history counts like the shared prefix
    assert served.reachable_prefix_hits(1000, sessions(0, 1, 100, 10, history=5000)) == 5000


class FakeSnapshot:
    def minus(self, before):
        return {"prefix_hits": 0, "prefix_queries": 0}


def test_every_request_is_seeded_the_same_in_every_server(monkeypatch):
    def one_server():
        sent = []

        def fake_stream(url, model, prompt, max_tokens, timeout, seed=0):
            sent.append((tuple(prompt), max_tokens, seed))
            return {"ids": [7] * max_tokens, "ttft_s": 0.01, "tpot_s": 0.001}

        monkeypatch.setattr(served, "stream_tokens", fake_stream)
        monkeypatch.setattr(served, "settled_snapshot", lambda url, settle_s=2.0: FakeSnapshot())
        rec = served.run_repeat("http://x", "m", sessions(16, 3, 4, 5, history=8), 1000, 2, 0, 1.0)
        return sent, rec

    (first, rec), (second, _) = one_server(), one_server()
    cold = [s for s in first if s[1] == 1]
    assert len(cold) == 2 and all(len(p) == 16 + 8 for p, _, _ in cold)  # sent once, untimed
    assert cold[0][0][:16] == cold[1][0][:16] and cold[0][0] != cold[1][0]  # shared, own history
    timed = [s for s in first if s[1] == 5]
    assert len(timed) == 6 and len({seed for _, _, seed in timed}) == 6
    assert sorted(first) == sorted(second)
    assert rec["output_tokens"] == 30 and rec["requests"] == 6 and not rec["errors"]
    assert rec["mean_prompt_tokens"] == pytest.approx(24 + (4 + 13 + 22) / 3)


def test_repeats_alternate_servers_and_warmups_stay_untimed(monkeypatch):
    calls = []

    def fake_repeat(url, model, work, vocab, conc, repeat, timeout):
        calls.append((url, repeat))
        return {"output_tok_s": 10.0 + repeat, "errors": [], "concurrency": conc}

    monkeypatch.setattr(served, "run_repeat", fake_repeat)
    a = served.Resident("a", {}, argparse.Namespace(url="A"), "m")
    b = served.Resident("b", {}, argparse.Namespace(url="B"), "m")
    reps = served.measure([a, b], sessions(1, 1, 1, 1), 100, 4, repeats=3, warmups=1,
                          timeout=1.0, drop=None)  # fmt: skip
    assert calls == [
        ("A", -1),
        ("B", -1),
        ("A", 0),
        ("B", 0),
        ("B", 1),
        ("A", 1),
        ("A", 2),
        ("B", 2),
    ]
    assert [r["output_tok_s"] for r in reps["a"]] == [10.0, 11.0, 12.0]
    s = served.summary(reps["a"])
    assert s["output_tok_s"] == 11.0 and s["output_tok_s_all"] == [10.0, 11.0, 12.0]


def test_a_server_that_fails_is_dropped_and_the_others_go_on(monkeypatch):
    def fake_repeat(url, model, work, vocab, conc, repeat, timeout):
        if url == "A" and repeat == 1:
            raise served.http.CompletionError("boom")
        return {"output_tok_s": 1.0, "errors": [], "concurrency": conc}

    monkeypatch.setattr(served, "run_repeat", fake_repeat)
    dropped = []
    a = served.Resident("a", {}, argparse.Namespace(url="A"), "m")
    b = served.Resident("b", {}, argparse.Namespace(url="B"), "m")
    reps = served.measure([a, b], sessions(1, 1, 1, 1), 100, 1, 3, 0, 1.0,
                          lambda s, exc: dropped.append((s.name, str(exc))))  # fmt: skip
    assert dropped == [("a", "boom")] and set(reps) == {"b"} and len(reps["b"]) == 3


def conc(c, tok_s_all, **extra):
    return {"concurrency": c, "repeats": len(tok_s_all), "output_tok_s_all": tok_s_all,
            "output_tok_s": sorted(tok_s_all)[len(tok_s_all) // 2], "prefix_hits": 0,
            "prefix_queries": 0, **extra}  # fmt: skip


def test_serving_pairs_each_plugin_server_with_the_same_instances_vllm_alone():
    servers = {
        "dspark3-alone#1": {"row": "dspark3-alone", "status": "ok", "concurrency": [conc(1, [100, 100])]},
        "dspark3-plugin#1": {"row": "dspark3-plugin", "status": "ok", "concurrency": [conc(1, [110, 120])]},
        "dspark3-alone#2": {"row": "dspark3-alone", "status": "ok", "concurrency": [conc(1, [50, 50])]},
        "dspark3-plugin#2": {"row": "dspark3-plugin", "status": "ok", "concurrency": [conc(1, [60, 55])]},
    }  # fmt: skip
    args = argparse.Namespace(
        concurrency=[1], repeats=2, warmup_repeats=0, instances=2, recipe=True, server_arg=[]
    )
    result = {"servers": servers, "models": {"target_kind": "nvfp4"}}
    (table,) = serving.tables(result, args, sessions(8192, 3, 256, 128))
    rows = {r[0]: dict(zip(table.columns, r)) for r in table.rows}
    assert rows["dspark3-plugin#1"]["x alone"] == "1.15 [1.10-1.20]"
    assert rows["dspark3-plugin#2"]["x alone"] == "1.15 [1.10-1.20]"
    assert rows["dspark3-alone#2"]["x alone"] == ""


def test_hits_over_reachable_uses_the_servers_block_size():
    work = sessions(8192, 3, 256, 128)
    entry = {"cache_config": {"block_size": "4336"}}
    full = conc(4, [1.0], prefix_hits=4 * 17344, prefix_queries=1)
    assert serving.hits_over_reachable(entry, full, work) == 1.0
    short = conc(16, [1.0, 1.0], prefix_hits=2 * 16 * 3 * 4336, prefix_queries=1)
    assert serving.hits_over_reachable(entry, short, work) == 0.75


def test_anchor_workload_and_its_comparison_with_nvidias_figure():
    args = argparse.Namespace(input_len=65536, reuse=0.9, shared_prefix=4096, output_len=400,
                              turns=2)  # fmt: skip
    work = anchor.workload(args)
    assert (work.shared, work.history, work.user, work.output) == (4096, 54886, 6554, 400)
    assert work.shared + work.history + work.user == 65536
    with pytest.raises(SystemExit, match="--reuse must be in"):
        anchor.workload(argparse.Namespace(**{**vars(args), "reuse": 1.0}))
    split = dict(server_queue_ms=900.0, server_prefill_ms=1500.0, server_decode_ms=5000.0)
    detail = [{"wall_s": 15.0}, {"wall_s": 14.0}, {"wall_s": 14.4}]
    servers = {"dspark7-plugin": {"row": "dspark7-plugin", "status": "ok",
                                  "concurrency": [conc(20, [2194.0 * 0.9], **split,
                                                       repeats_detail=detail)]}}  # fmt: skip
    ns = argparse.Namespace(concurrency=[20], repeats=1, warmup_repeats=0, instances=1, recipe=True,
                            server_arg=[])  # fmt: skip
    (table,) = anchor.tables({"servers": servers, "models": {"target_kind": "nvfp4"}}, ns, work)
    row = dict(zip(table.columns, table.rows[0]))
    assert row["NVIDIA (conc, acceptance)"] == "2194 (20, 3.69)" and row["x NVIDIA"] == "0.90"
    assert row["s a turn"] == "7.20"  # the median repeat (14.4 s) over its 2 turns
    assert row["server queue / prefill / decode ms"] == "900 / 1500 / 5000"


def test_a_server_with_no_time_left_for_a_concurrency_says_so_in_its_row():
    class Stopped:
        def log(self):
            return ""

    line = "c20: skipped: time budget (concurrency 20 needs ~47 s, 43 s of --budget-s 290 left)"
    why = line.partition(": ")[2]
    assert served.skipped_line(20, why) == line  # the format earlier results JSON keeps
    assert served.parse_skipped_line(line) == (20, why)
    started = served.Resident("dspark7-plugin", {"row": "dspark7-plugin", "status": "running",
                              "concurrency": [], "skipped": [line]}, Stopped())  # fmt: skip
    served.finish(started)
    assert started.entry["status"].startswith("skipped")  # not "ok": it measured nothing
    servers = {
        "dspark7-alone": {"row": "dspark7-alone", "status": "ok", "concurrency": [conc(4, [1.0])],
                          "skipped": [line]},
        "dspark7-plugin": started.entry,
        "dflash5-plugin": {"row": "dflash5-plugin", "status": "error: did not start",
                           "concurrency": []},
        "dflash5-alone": {"row": "dflash5-alone", "status": "error: died in c4",
                          "concurrency": [], "skipped": [line]},
    }  # fmt: skip
    work = sessions(0, 2, 6554, 400, history=58982)
    ns = argparse.Namespace(concurrency=[4, 20], repeats=1, warmup_repeats=0, instances=1,
                            recipe=True, server_arg=[])  # fmt: skip
    result = {"servers": servers, "models": {"target_kind": "nvfp4"}}
    for table, *_ in (anchor.tables(result, ns, work), serving.tables(result, ns, work)):
        rows = [dict(zip(table.columns, r)) for r in table.rows]
        cells = [(r["server"], r["conc"], r["status"]) for r in rows]
        budget = line.partition(": ")[2]
        assert ("dspark7-alone", "20", budget) in cells
        assert ("dspark7-plugin", "20", budget) in cells
        assert ("dspark7-alone", "4", "ok") in cells
        assert ("dflash5-plugin", "", "error: did not start") in cells
        assert ("dflash5-alone", "", "error: died in c4") in cells  # not hidden by the skip
        assert ("dflash5-alone", "20", budget) in cells
        assert len(rows) == 6


def test_a_profiled_repeat_is_configured_and_reported():
    config = served.profiler_config(Path("rel/traces"), 16, cuda=True)
    assert config["torch_profiler_dir"] == str(Path("rel/traces").resolve())  # absolute for vLLM
    assert config["torch_profiler_activities"] == ["CUDA"] and config["max_iterations"] == 16
    assert config["ignore_frontend"] and not config["torch_profiler_with_stack"]
    assert served.profiler_config(Path("/t"), 2, cuda=False)["torch_profiler_activities"] == ["CPU"]
    assert config["delay_iterations"] == 0
    later = served.profiler_config(Path("/t"), 16, cuda=True, skip=40)
    assert later["delay_iterations"] == 41 and later["max_iterations"] == 16
    families = {"MoE experts": 30.0, "attention": 10.0, "Mamba": 5.0, "other GEMMs": 5.0,
                "rest": 0.0}  # fmt: skip
    ok = {"status": "ok", "steps": 16, "busy_ms": 52.5, "span_ms": 60.0,
          "families_ms": families, "top_kernels": [["marlin_moe_wna16::Marlin", 30.0, 832]]}  # fmt: skip
    servers = {"a": {"concurrency": [conc(20, [1.0], profile=ok)]},
               "b": {"concurrency": [conc(20, [1.0], profile={"status": "error: no trace"})]},
               "c": {"concurrency": [conc(20, [1.0])]},
               "d": {"concurrency": [conc(20, [1.0], profile={**ok, "skip_steps": 40})]}}  # fmt: skip
    (table,) = served.profile_tables(servers)
    assert [r[0] for r in table.rows] == ["a", "b", "d"]  # an unprofiled server has no row
    row = dict(zip(table.columns, table.rows[0]))
    assert row["steps"] == "1-16" and row["MoE experts"] == "30.0 (60%)"
    assert row["GPU-busy ms (a step)"] == "52.5 (3.3)" and row["span ms (a step)"] == "60.0 (3.8)"
    assert row["top kernel"] == "marlin_moe_wna16::Marlin (30.0 ms)"
    assert table.rows[1][-1] == "error: no trace"
    assert dict(zip(table.columns, table.rows[2]))["steps"] == "41-56"  # past the prefill
    assert served.profile_tables({"c": servers["c"]}) == []


@pytest.mark.parametrize("skip", [0, 500])
def test_a_profile_without_a_trace_is_an_error_naming_a_skip_the_turns_may_not_reach(
    skip, tmp_path, monkeypatch
):
    monkeypatch.setattr(served, "run_repeat", lambda *args, **kwargs: {"errors": []})
    monkeypatch.setattr(served.http, "post_json", lambda *args, **kwargs: (200, {}))
    server = served.Resident("a", {}, argparse.Namespace(url="http://127.0.0.1:9"), "m")
    work = served.Sessions(0, 10, 5, 4, 1)
    with pytest.raises(served.http.CompletionError, match="no profiler trace") as caught:
        served.profile_repeat(server, work, 100, 2, 16, skip, tmp_path, 1.0, wait_s=0.0)
    assert ("--profile-skip-steps 500" in str(caught.value)) == bool(skip)


@pytest.mark.parametrize("skip, steps", [(0, 3), (1, 2), (5, 4)])
def test_vllms_profiler_records_the_steps_after_the_skipped_ones(skip, steps, tmp_path):
    """vLLM's own worker profiler, driven as its worker drives it (``step()`` at the top of each
    engine step), with the settings a server is given: it records steps skip+1 .. skip+steps."""
    from vllm.config import ProfilerConfig
    from vllm.profiler.wrapper import WorkerProfiler

    class Recorder(WorkerProfiler):
        def _start(self):
            pass

        def _stop(self):
            pass

    config = ProfilerConfig(**served.profiler_config(tmp_path, steps, cuda=False, skip=skip))
    profiler, recorded = Recorder(config), []
    profiler.start()  # POST /start_profile
    for step in range(1, skip + steps + 5):
        profiler.step()
        if profiler.is_running:
            recorded.append(step)
    assert recorded == list(range(skip + 1, skip + steps + 1))


@pytest.mark.parametrize("text", ["-1", "two", "1.5"])
@pytest.mark.parametrize("option", ["--profile-steps", "--profile-skip-steps"])
def test_profile_steps_refuses_what_is_not_a_step_count(option, text, capsys):
    parser = argparse.ArgumentParser()
    served.add_server_arguments(parser, kv_cache_gib=8.0)
    args = parser.parse_args([option, "16"])
    assert getattr(args, option[2:].replace("-", "_")) == 16
    with pytest.raises(SystemExit):
        parser.parse_args([option, text])
    assert "expected 0 (none) or a number of engine steps" in capsys.readouterr().err


def test_skipping_steps_without_recording_any_is_refused():
    parser = argparse.ArgumentParser()
    served.add_server_arguments(parser, kv_cache_gib=8.0)
    with pytest.raises(SystemExit, match="--profile-skip-steps 24 needs --profile-steps N"):
        served.check_profile_options(parser.parse_args(["--profile-skip-steps", "24"]))
    served.check_profile_options(parser.parse_args(["--profile-skip-steps", "24",
                                                    "--profile-steps", "16"]))  # fmt: skip
    served.check_profile_options(parser.parse_args(["--profile-steps", "16"]))


def test_the_flags_line_names_every_extra_server_argument():
    """A report's reader sees the server arguments the rows were measured with, the extra ones
    (--server-arg) included: two runs that differ only there must not read alike."""
    work = sessions(0, 2, 6554, 400, history=58982)
    result = {"models": {"target_kind": "nvfp4"}, "setup": {}}
    ns = argparse.Namespace(concurrency=[20], repeats=1, warmup_repeats=0, instances=1,
                            recipe=True, server_arg=["--max-num-batched-tokens=8832"])  # fmt: skip
    flags = serving.setup_lines(result, ns, work)["flags"]
    assert flags == " ".join([*served.RECIPE_FLAGS, "--max-num-batched-tokens=8832"])
    ns.recipe, ns.server_arg = False, []
    assert serving.setup_lines(result, ns, work)["flags"] == "engine defaults"
