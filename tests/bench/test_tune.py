"""``tune`` without an engine: the schedule arithmetic on hand-computed cases, the report and plot
from given measurements, and every refusal before an engine starts (the engine run is in
``tests/e2e/test_batch_size_schedule.py``)."""

from __future__ import annotations

import contextlib
import io
import json
import shlex
import time
import types

import pytest

from tests import draft_configs as dc
from vllm_nemotron_spec.bench import schedule as sch
from vllm_nemotron_spec.bench import tune
from vllm_nemotron_spec.cli.main import main
from vllm_nemotron_spec.runs import SpecCounters

# A worked example. Acceptance per position 0.9, 0.6: E[accepted | k] = 0, 0.9, 1.5.
PER_POSITION = [0.9, 0.6]
STEP_MS = {  # (batch, k) -> ms
    (1, 0): 10, (1, 1): 12, (1, 2): 14,
    (2, 0): 11, (2, 1): 15, (2, 2): 21,
    (4, 0): 12, (4, 1): 22, (4, 2): 35,
    (8, 0): 14, (8, 1): 32, (8, 2): 60,
}  # fmt: skip
# tokens/s = batch * (1 + E) / step:
#   batch 1: 100.0, 158.3, 178.6 -> k=2    batch 2: 181.8, 253.3, 238.1 -> k=1
#   batch 4: 333.3, 345.5, 285.7 -> k=1    batch 8: 571.4, 475.0, 333.3 -> k=0
CHOICE = {1: 2, 2: 1, 4: 1, 8: 0}
RANGES = [[1, 1, 2], [2, 7, 1], [8, 8, 0]]


def _step_seconds():
    return {key: ms / 1000 for key, ms in STEP_MS.items()}


@pytest.mark.parametrize(
    "max_batch, grid",
    [
        (1, [1]),
        (2, [1, 2]),
        (6, [1, 2, 4, 6]),
        (16, [1, 2, 4, 8, 16]),
        (64, [1, 2, 4, 8, 16, 32, 64]),
    ],
)
def test_batch_grid(max_batch, grid):
    assert sch.batch_grid(max_batch) == grid


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_batch_grid_refuses_below_one(bad):
    with pytest.raises(sch.ScheduleError, match=r"--max-batch must be an integer >= 1, found"):
        sch.batch_grid(bad)


def test_expected_accepted_sums_the_first_k_positions():
    assert [sch.expected_accepted([0.8, 0.5, 0.2], k) for k in range(4)] == pytest.approx(
        [0.0, 0.8, 1.3, 1.5]
    )
    with pytest.raises(
        sch.ScheduleError, match=r"k = 4: acceptance was measured for positions 1\.\.3"
    ):
        sch.expected_accepted([0.8, 0.5, 0.2], 4)


@pytest.mark.parametrize(
    "rates, message",
    [([0.5, 0.7], r"must not increase with the position: \[0\] = 0.5 < \[1\] = 0.7"),
     ([1.2], r"acceptance\[0\] must lie in \[0, 1\], found 1.2")],
)  # fmt: skip
def test_per_position_rates_are_checked(rates, message):
    with pytest.raises(sch.ScheduleError, match=message):
        sch.expected_accepted(rates, 1)


def test_expected_tokens_per_s():
    # 4 requests x (1 + 0.8 + 0.5) tokens every 10 ms
    assert sch.expected_tokens_per_s(4, [0.8, 0.5], 2, 0.010) == pytest.approx(920.0)
    assert sch.expected_tokens_per_s(3, [0.8, 0.5], 0, 0.020) == pytest.approx(150.0)
    with pytest.raises(sch.ScheduleError, match="step time of batch 1, k 0 must be > 0"):
        sch.expected_tokens_per_s(1, [0.8], 0, 0.0)


def test_choice_on_the_worked_example():
    rates = sch.rate_table(PER_POSITION, _step_seconds())
    assert rates[(1, 2)] == pytest.approx(2.5 / 0.014)
    assert rates[(4, 1)] == pytest.approx(4 * 1.9 / 0.022)
    assert sch.choose_schedule(rates) == CHOICE
    assert sch.merge_ranges(CHOICE) == RANGES


def test_ties_go_to_the_smaller_k():
    assert sch.choose_k({0: 5.0, 1: 7.0, 2: 7.0}) == 1
    assert sch.choose_k({3: 1.0, 2: 1.0}) == 2


@pytest.mark.parametrize(
    "choice, ranges",
    [
        ({1: 3}, [[1, 1, 3]]),
        ({1: 3, 2: 3, 4: 3}, [[1, 4, 3]]),
        ({1: 0, 2: 5, 4: 5, 8: 0}, [[1, 1, 0], [2, 7, 5], [8, 8, 0]]),
        ({1: 2, 2: 1, 4: 2, 6: 2}, [[1, 1, 2], [2, 3, 1], [4, 6, 2]]),
    ],
)
def test_merge_ranges(choice, ranges):
    assert sch.merge_ranges(choice) == ranges


def test_merge_ranges_needs_batch_one():
    with pytest.raises(sch.ScheduleError, match="must start at 1 .* found 2"):
        sch.merge_ranges({2: 1, 4: 0})


@pytest.mark.parametrize("max_num_seqs", [8, 13, 64])
def test_vllm_reads_the_ranges_as_chosen(max_num_seqs):
    """vLLM's own dense lookup of the merged ranges gives each grid batch size its chosen k,
    each batch size between grid points the k of the grid point below, and the last k beyond."""
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    lookup = build_dynamic_sd_schedule_lookup(RANGES, max_num_seqs, 2)
    grid = sorted(CHOICE)
    for b in range(1, max_num_seqs + 1):
        below = max(g for g in grid if g <= b)
        assert lookup[b] == CHOICE[below] == sch.k_for_batch(RANGES, b, 2), b


def test_k_for_batch_caps_at_num_speculative_tokens():
    assert sch.k_for_batch([[1, 2, 5], [8, 9, 1]], 4, 3) == 3  # the gap keeps 5, capped at 3
    assert sch.k_for_batch([[1, 2, 5], [8, 9, 1]], 50, 3) == 1


def test_speculative_config():
    config = sch.speculative_config("dspark", "/d", RANGES, {"attention_backend": "FLASH_ATTN"})
    assert config == {
        "method": "dspark",
        "model": "/d",
        "attention_backend": "FLASH_ATTN",
        "num_speculative_tokens": 2,
        "num_speculative_tokens_per_batch_size": RANGES,
    }
    assert sch.speculative_config("dflash", "/d", [[1, 16, 0]]) is None


def test_vllm_accepts_the_config():
    from vllm.v1.spec_decode.dynamic.utils import validate_and_normalize_dynamic_sd_schedule

    config = sch.speculative_config("dspark", "/d", RANGES)
    schedule = config["num_speculative_tokens_per_batch_size"]
    assert validate_and_normalize_dynamic_sd_schedule(schedule) == [tuple(r) for r in RANGES]


# --------------------------------------------------------------------------------------------
# The report from given measurements.


def _plan(**changes):
    values = dict(
        target="/t",
        method="dspark",
        draft="/d",
        ks=(0, 1, 2),
        batch_sizes=(1, 2, 4, 8),
        block_limit=8,
    )
    values.update(changes)
    return tune.TunePlan(**values)


def _measurements(sampled=None, plain_ms=None):
    timings = [
        tune.StepTiming(b, k, [ms / 1000] * 3, [b * (1 + k)] * 3) for (b, k), ms in STEP_MS.items()
    ]
    greedy = SpecCounters(num_drafts=100, num_draft_tokens=200, num_accepted_tokens=150,
                          accepted_per_position=[90, 60])  # fmt: skip
    acceptance = {"greedy": greedy}
    if sampled is not None:
        acceptance["sampled"] = sampled
    plain = [tune.StepTiming(b, 0, [ms / 1000] * 3, [b] * 3) for b, ms in (plain_ms or {}).items()]
    return tune.Measurements(acceptance, timings, 12.5, 4.5, plain, 2.0 if plain else None)


class _Prompts:
    source, prompts = "tiny-family", ("a", "b", "c")


def _report(plan=None, measurements=None):
    return tune.tune_report(
        plan or _plan(),
        measurements or _measurements(),
        prompts=_Prompts,
        platform="cpu",
        vllm_version="0.32.0",
    )


def test_report_on_the_worked_example():
    report = _report()
    assert report["acceptance_used"] == "greedy"
    assert report["expected_accepted"] == {"0": 0.0, "1": 0.9, "2": 1.5}
    assert [(c["batch"], c["k"]) for c in report["chosen"]] == sorted(CHOICE.items())
    assert report["chosen"][1]["speedup_vs_k0"] == pytest.approx(253.333 / 181.818, abs=1e-3)
    assert report["block"] == 2
    assert report["schedule"] == RANGES
    assert report["speculative_config"]["num_speculative_tokens_per_batch_size"] == RANGES
    cell = next(m for m in report["measurements"] if (m["batch"], m["k"]) == (4, 1))
    assert cell["expected_tokens_per_s"] == pytest.approx(345.455, abs=1e-3)
    assert cell["step_ms"] == 22 and cell["measured_tokens_per_step"] == 2.0
    json.dumps(report, allow_nan=False)


def test_report_uses_sampled_acceptance_when_sampling():
    """At a temperature, the schedule follows the sampled acceptance: here drafts are rarely
    accepted, so k = 0 wins everywhere and no config is offered (serve plain decoding)."""
    sampled = SpecCounters(num_drafts=100, num_draft_tokens=200, num_accepted_tokens=10,
                           accepted_per_position=[10, 0])  # fmt: skip
    report = _report(_plan(temperature=0.8), _measurements(sampled))
    assert report["acceptance_used"] == "sampled"
    assert report["schedule"] == [[1, 8, 0]]
    assert report["speculative_config"] is None


def test_text_report_and_serving_commands(monkeypatch):
    from vllm_nemotron_spec.bench import tune_report as tr

    monkeypatch.setattr("vllm_nemotron_spec.commands.serve_program", lambda: "vllm serve")
    text = tr.format_tune_report(_report(), "/out/schedule.json")
    # the measuring engine's settings (runs.make_llm's small-model defaults here) come first
    settings = "--dtype float32 --enforce-eager --max-model-len 512"
    assert f"vllm serve /t {settings} --speculative-config '" in text
    config = json.loads(text.split("--speculative-config '")[1].split("'")[0])
    assert config["num_speculative_tokens_per_batch_size"] == RANGES
    kwargs = "dtype='float32', enforce_eager=True, max_model_len=512"
    assert f"{kwargs}, speculative_config=json.load(open('/out/schedule.json'))" in text
    assert "batch sizes above 8 keep k=0" in text
    # k=1 at 2..7 is verified from a block of 2: the same k alone drafts less (k=0 is plain's)
    assert "every step drafts the block of 2; at batch sizes 2-7 (k=1) only k are verified" in text
    row = next(line for line in text.splitlines() if line.strip().startswith("4 "))
    assert row.count("*") == 1 and "345.5*" in row
    plain = tr.format_tune_report(_report(_plan(temperature=0.8), _measurements(
        SpecCounters(100, 200, 10, [10, 0]))))  # fmt: skip
    assert "no k above 0 pays at any measured batch size: serve plain decoding" in plain


GPU_ENGINE = dict(  # what tune's engine ran with for a real model on a GPU (cli/tune.py)
    dtype="auto", enforce_eager=False, max_model_len=None, max_num_seqs=64,
    gpu_memory_utilization=0.9, kv_cache_dtype="fp8", moe_backend="marlin",
    enable_prefix_caching=False, compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE"},
)  # fmt: skip
SERVED = {"compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE"},
          "enable_prefix_caching": False, "kv_cache_dtype": "fp8", "moe_backend": "marlin"}  # fmt: skip


def test_the_report_keeps_the_engine_settings_serving_must_repeat():
    """vLLM's defaults and the measuring-only settings (max_num_seqs, memory share, seed) are
    dropped; every other setting tune's engine ran with is kept."""
    assert tune.serving_engine_args(GPU_ENGINE) == SERVED
    assert _report(_plan(engine_kwargs=GPU_ENGINE))["engine_args"] == SERVED
    # the small-model defaults runs.make_llm starts from count as settings too
    assert tune.serving_engine_args({}) == {
        "dtype": "float32", "enforce_eager": True, "max_model_len": 512}  # fmt: skip


def test_the_printed_commands_carry_the_engine_settings(monkeypatch, tmp_path):
    """The printed ``vllm serve`` command parses, with vLLM's own argument parser, into the
    settings tune measured with and the schedule; the printed ``LLM`` line passes them too."""
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_nemotron_spec.bench import tune_report as tr

    monkeypatch.setattr("vllm_nemotron_spec.commands.serve_program", lambda: "vllm serve")
    report = _report(_plan(engine_kwargs=GPU_ENGINE))
    argv = shlex.split(tr.serve_command(report))
    assert argv[:3] == ["vllm", "serve", "/t"]
    parser = FlexibleArgumentParser()
    AsyncEngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--model", *argv[2:]])
    assert (args.kv_cache_dtype, args.moe_backend, args.enable_prefix_caching) == (
        "fp8", "marlin", False)  # fmt: skip
    assert args.compilation_config.cudagraph_mode.name == "FULL_AND_PIECEWISE"
    assert args.speculative_config == report["speculative_config"]

    schedule = tmp_path / "schedule.json"
    schedule.write_text(json.dumps(report["speculative_config"]))
    seen = {}
    example = tr.llm_example(report, str(schedule)).replace("from vllm import LLM\n", "")
    exec(example, {"json": json, "LLM": lambda **kw: seen.update(kw)})  # noqa: S102
    assert seen == {"model": "/t", **SERVED, "speculative_config": report["speculative_config"]}


# Plain decoding of the worked example: 8, 9, 10, 10 ms at batch 1, 2, 4, 8 -> 125, 222.2, 400,
# 800 tokens/s. Against the chosen k (178.6, 253.3, 345.5, 571.4): 1.43x, 1.14x, then plain wins.
PLAIN_MS = {1: 8, 2: 9, 4: 10, 8: 10}


def test_report_sets_the_schedule_beside_plain_decoding(monkeypatch):
    from vllm_nemotron_spec.bench import tune_report as tr

    report = _report(measurements=_measurements(plain_ms=PLAIN_MS))
    assert report["schema"] == "vllm-nemotron-spec.tune/5"
    assert report["plain"][1] == {"batch": 2, "step_ms": 9.0, "step_ms_quartiles": [9.0, 9.0],
                                  "steps": 3, "measured_tokens_per_step": 1.0,
                                  "tokens_per_s": pytest.approx(222.222, abs=1e-3)}  # fmt: skip
    speedups = [c["speedup_vs_plain"] for c in report["chosen"]]
    assert speedups == pytest.approx(
        [178.571 / 125, 253.333 / 222.222, 345.455 / 400, 571.429 / 800], abs=1e-3
    )
    assert report["plain_faster_at"] == [4, 8]
    assert report["speculative_config"]["num_speculative_tokens_per_batch_size"] == RANGES
    assert report["plain_engine_start_s"] == 2.0
    monkeypatch.setattr("vllm_nemotron_spec.commands.serve_program", lambda: "vllm serve")
    text = tr.format_tune_report(report)
    assert "plain decoding serves more tokens/s than the chosen k at batch 4, 8" in text
    assert "batch 1: k=2 (1.43x plain decoding)" in text
    row = next(line for line in text.splitlines() if line.strip().startswith("8 "))
    assert row.rstrip().endswith("10.00 /   800.0")


def test_no_config_when_plain_decoding_serves_more_at_every_batch_size():
    fast = {b: 1 for b in PLAIN_MS}  # 1 ms a step: 1,000 tokens/s a request
    report = _report(measurements=_measurements(plain_ms=fast))
    assert report["plain_faster_at"] == [1, 2, 4, 8]
    assert report["schedule"] == RANGES  # the best k per batch size, as measured
    assert report["speculative_config"] is None  # but none beats plain decoding
    from vllm_nemotron_spec.bench.tune_report import format_tune_report

    text = format_tune_report(report)
    assert "plain decoding serves more tokens/s than any k at every measured batch size" in text
    assert "vllm serve" not in text


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    from vllm_nemotron_spec.bench.tune_report import plot_tune_report

    path = plot_tune_report(
        _report(measurements=_measurements(plain_ms=PLAIN_MS)), tmp_path / "tune.png"
    )
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_step_timing_json():
    t = tune.StepTiming(2, 1, [0.010, 0.012, 0.011, 0.030], [4, 3, 4, 3])
    out = t.to_json()
    assert out["step_ms"] == pytest.approx(11.5)
    q1, q3 = out["step_ms_quartiles"]
    assert q1 <= 11.5 <= q3
    assert out["measured_tokens_per_step"] == pytest.approx(14 / 8)
    assert t.scattered  # one slow step in four: quartiles far apart
    assert not tune.StepTiming(2, 1, [0.010, 0.011, 0.0105, 0.0102], [4] * 4).scattered


def test_scattered_points_are_reported():
    m = _measurements()
    m.timings[0].seconds = [0.010, 0.030, 0.010, 0.030]  # batch 1, k 0
    report = _report(measurements=m)
    assert report["scattered"] == [[1, 0]]
    from vllm_nemotron_spec.bench.tune_report import format_tune_report

    assert "warning: step times scattered at 1 of 12 points" in format_tune_report(report)
    assert _report()["scattered"] == []
    with_plain = _measurements(plain_ms=PLAIN_MS)
    with_plain.plain[2].seconds = [0.010, 0.030, 0.010, 0.030]  # plain decoding, batch 4
    report = _report(measurements=with_plain)
    assert report["scattered"] == [] and report["plain_scattered"] == [4]
    assert (
        "warning: step times scattered at 1 of 16 points (quartiles more than 25% of the median "
        "apart: plain decoding at batch 4)" in format_tune_report(report)
    )


def test_progress_eta(capsys):
    meter = tune.Progress(starts=2, measures=3)
    meter.done("start", 10.0, "engine started")  # left: 1 start (10 s) + 3 measures (not timed)
    meter.done("measure", 2.0, "batch 1")  # left: 1 start (10 s) + 2 measures (2 s)
    meter.done("start", 12.0, "engine started")  # left: 2 measures (2 s)
    meter.done("measure", 4.0, "batch 2")
    meter.done("measure", 3.0, "batch 4")
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "tune [1/5] engine started (10.0 s; ETA unknown)",
        "tune [2/5] batch 1 (2.0 s; ETA 14s)",
        "tune [3/5] engine started (12.0 s; ETA 4s)",
        "tune [4/5] batch 2 (4.0 s; ETA 3s)",
        "tune [5/5] batch 4 (3.0 s; done)",
    ]


def test_progress_eta_names_a_later_engine_start_it_cannot_time_yet(capsys):
    """The plain-decoding engine starts after the measuring one, with compilation cached: its
    start is not guessed from the first (cold) one, it is named until it has been timed."""
    meter = tune.Progress(starts=1, measures=3, restarts=1)
    meter.done("start", 300.0, "engine started")  # left: 3 measures (not timed) + a restart
    meter.done("measure", 2.0, "batch 1")  # left: 2 measures (2 s) + a restart (not timed)
    meter.done("measure", 4.0, "batch 2")
    meter.done("restart", 20.0, "plain engine started")  # left: 1 measure (3 s)
    meter.done("measure", 3.0, "plain, batch 1")
    assert capsys.readouterr().err.splitlines() == [
        "tune [1/5] engine started (300.0 s; ETA unknown)",
        "tune [2/5] batch 1 (2.0 s; ETA 4s + an engine start)",
        "tune [3/5] batch 2 (4.0 s; ETA 3s + an engine start)",
        "tune [4/5] plain engine started (20.0 s; ETA 3s)",
        "tune [5/5] plain, batch 1 (3.0 s; done)",
    ]


def test_a_long_wait_says_so_until_it_ends(capsys):
    """An engine start gets a line every ``every_s`` until it returns, none after."""
    meter = tune.Progress(starts=1, measures=1)
    seen = ""
    with meter.waiting("the engine is starting", every_s=0.01):
        deadline = time.monotonic() + 30
        while not seen and time.monotonic() < deadline:  # however loaded the machine
            time.sleep(0.01)
            seen += capsys.readouterr().err
    assert seen.startswith("tune: the engine is starting (0s so far)\n"), seen
    capsys.readouterr()
    time.sleep(0.05)
    assert capsys.readouterr().err == ""  # the thread ended with the block
    quiet = tune.Progress(starts=1, measures=1, enabled=False)
    with quiet.waiting("x", every_s=0.01):
        time.sleep(0.05)
    assert capsys.readouterr().err == ""


def test_the_largest_k_is_measured_first():
    assert _plan(ks=(0, 1, 2, 3)).k_order == [3, 0, 1, 2]


def test_one_engine_starts_with_every_measured_k_in_its_schedule():
    """The whole block (the largest k) drafted; every measured k in the start-up schedule, so the
    runner captures its graphs; vLLM's dense lookup of that schedule holds exactly those k."""
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    plan = _plan(ks=(0, 2, 5), speculative_extra={"attention_backend": "FLASH_ATTN"})
    config = plan.speculative_config()
    assert config == {
        "method": "dspark",
        "model": "/d",
        "attention_backend": "FLASH_ATTN",
        "num_speculative_tokens": 5,
        "num_speculative_tokens_per_batch_size": [[1, 1, 0], [2, 2, 2], [3, 8, 5]],
    }
    lookup = build_dynamic_sd_schedule_lookup(
        config["num_speculative_tokens_per_batch_size"], plan.max_num_seqs, 5
    )
    assert set(lookup[1:]) == {0, 2, 5}


def test_more_k_than_batch_sizes_get_a_slot_each():
    """A grid smaller than the number of k: the engine gets a request slot per k (its schedule
    must name each k at some batch size), and keeps a larger max_num_seqs it was given."""
    plan = _plan(ks=(0, 1, 2, 3), batch_sizes=(1, 2))
    assert plan.max_num_seqs == 4
    assert plan.speculative_config()["num_speculative_tokens_per_batch_size"] == [
        [1, 1, 0], [2, 2, 1], [3, 3, 2], [4, 4, 3]
    ]  # fmt: skip
    assert _plan(engine_kwargs={"max_num_seqs": 32}).max_num_seqs == 32


def test_a_smaller_served_block_is_said():
    """A schedule whose largest k is below the measured block is served with the smaller block."""
    from vllm_nemotron_spec.bench.tune_report import format_tune_report

    report = _report()
    assert report["speculative_config"]["num_speculative_tokens"] == report["block"] == 2
    assert "served with a block" not in format_tune_report(report)
    report["block"] = 4  # as if k = 4 had been measured and never chosen
    assert "(served with a block of 2, the schedule's largest k" in format_tune_report(report)


# --------------------------------------------------------------------------------------------
# Refusals, each before any engine starts.


@pytest.fixture
def no_engine(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("an engine was started")

    monkeypatch.setattr(tune, "run_tune", refuse)


def _tune(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["tune", *map(str, argv)])
    return code, err.getvalue()


@pytest.fixture(scope="module")
def generic_dspark(tmp_path_factory):
    path = tmp_path_factory.mktemp("generic") / "dspark"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(dc.generic_dspark_config()))
    return path


def test_refusals(tiny_family, generic_dspark, tmp_path, no_engine):
    target, dspark = tiny_family.target, tiny_family.dspark_draft
    pair = [target, "--method", "dspark", "--draft", dspark]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    foreign = tmp_path / "notes.json"
    foreign.write_text('{"hello": 1}')
    cases = [
        ([*pair, "--max-batch", "0"], "--max-batch must be an integer >= 1, found 0"),
        ([*pair, "--prompts", empty], f"{empty}: no prompts"),
        ([*pair, "--k", "0,9"], "--k 9: num_speculative_tokens=9 exceeds the trained block_size 8"),
        ([*pair, "--k", "0,x"], "--k '0,x': expected comma-separated integers"),
        ([*pair, "--k", "0"], "--k: nothing to tune; give at least one k >= 1"),
        ([*pair, "--k", "0,-1"], "--k: every k must be an integer >= 0, found -1"),
        ([*pair, "--steps", "0"], "--steps must be >= 1, found 0"),
        ([*pair, "--out", foreign], "is not a schedule this command wrote; refusing"),
        (
            [*pair, "--speculative-arg", "num_speculative_tokens=3"],
            "--speculative-arg: num_speculative_tokens is set by tune itself",
        ),
        (
            [target, "--method", "dflash", "--draft", dspark],
            "--method dflash: the draft is a dspark draft (Qwen3DSparkModel); use --method dspark",
        ),
        (
            [dspark, "--method", "dspark", "--draft", dspark],
            "not a NemotronH model (NemotronHForCausalLM)",
        ),
        (
            [target, "--method", "dspark", "--draft", generic_dspark],
            "a Qwen3DSparkModel draft without the Nemotron 3.5 layout",
        ),
        ([target, "--method", "dspark", "--draft", tmp_path / "none"], "--draft"),
    ]
    for argv, message in cases:
        code, err = _tune(*argv)
        assert code == 2 and message in err, (argv, err)
        assert "Traceback" not in err


def test_refused_before_any_engine_where_the_k_switch_is_not_installed(tiny_family, monkeypatch):
    """tune sets each k on its one running engine: without that patch it refuses in one line."""
    from vllm_nemotron_spec import patches, plugin, runs

    def refuse(*args, **kwargs):
        raise AssertionError("an engine was started")

    # registered first, so that the patch state this test overrides is restored, not dropped,
    # for the tests after it in this process
    plugin.register()
    monkeypatch.setattr(runs, "make_llm", refuse)
    monkeypatch.setitem(patches._state, "engine_core_spec_tokens",
                        "not installed: vllm.v1.core.sched.scheduler.Scheduler.schedule changed")  # fmt: skip
    code, err = _tune(tiny_family.target, "--method", "dspark", "--draft", tiny_family.dspark_draft)
    assert code == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == (
        "vllm-nemotron-spec tune: tune (one engine for every k) needs the vllm-nemotron-spec patch "
        "engine_core_spec_tokens (v1.engine.core.EngineCore.nemotron_spec_set_num_spec_tokens "
        "(added)), which is not installed: vllm.v1.core.sched.scheduler.Scheduler.schedule "
        f"changed (vLLM {patches.vllm_version()})"
    )


def test_a_rewritten_schedule_file_may_be_replaced(tmp_path):
    from vllm_nemotron_spec.cli.tune import check_schedule_file, write_schedule_file

    dest = check_schedule_file(tmp_path / "s.json")
    write_schedule_file(dest, {"method": "dspark", "num_speculative_tokens": 2})
    assert check_schedule_file(dest) == dest
    assert json.loads(dest.read_text()) == {"method": "dspark", "num_speculative_tokens": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["s.json"]  # no temporary left behind


class _ChunkedPrefillEngine:
    """vLLM's engine as ``time_decode_steps`` drives it, reduced to the scheduling that matters
    here: prompts prefill in chunks of ``budget`` tokens per step (in arrival order), a request
    emits its first token when its prompt is done and ``k + 1`` tokens per step after that
    (every draft accepted: the fastest a request can finish), and it finishes at
    ``max_tokens``."""

    def __init__(self, budget: int, k: int, max_model_len: int = 100_000):
        self.k, self.now = k, 0.0
        self.vllm_config = types.SimpleNamespace(
            scheduler_config=types.SimpleNamespace(max_num_batched_tokens=budget)
        )
        self.model_config = types.SimpleNamespace(max_model_len=max_model_len)
        self.budget = budget
        self.requests: dict[str, dict] = {}

    def add_request(self, rid, prompt, params):
        self.requests[rid] = {
            "left": len(prompt["prompt_token_ids"]),
            "out": 0,
            "max": params.max_tokens,
        }

    def has_unfinished_requests(self):
        return bool(self.requests)

    def abort_request(self, ids):
        for rid in ids:
            self.requests.pop(rid, None)

    def step(self):
        self.now += 0.01
        budget, outs = self.budget, []
        for rid, r in list(self.requests.items()):
            if r["left"] > 0:  # prefilling
                chunk = min(budget, r["left"])
                r["left"] -= chunk
                budget -= chunk
                new = 1 if r["left"] == 0 else 0
            else:
                new = min(self.k + 1, r["max"] - r["out"])
            if not new:
                continue
            r["out"] += new
            finished = r["out"] >= r["max"]
            if finished:
                del self.requests[rid]
            outs.append(
                types.SimpleNamespace(
                    request_id=rid,
                    finished=finished,
                    outputs=[types.SimpleNamespace(token_ids=[0] * new)],
                    metrics=types.SimpleNamespace(last_token_ts=self.now),
                )
            )
        return outs


@pytest.mark.parametrize("k", [0, 1, 7])
@pytest.mark.parametrize("batch, budget", [(1, 4096), (2, 1024), (8, 2048), (64, 8192)])
def test_every_batch_decodes_the_steps_timed_while_its_prompts_prefill_in_chunks(batch, budget, k):
    """A batch whose prompts prefill over several steps (1,023 tokens each, ``budget`` per step)
    still gives every timed step with all its requests decoding: the first requests must not
    finish while the last ones are still prefilling (at k=0 one token a step leaves no slack)."""
    engine = _ChunkedPrefillEngine(budget, k)
    llm = types.SimpleNamespace(llm_engine=engine)
    plan = types.SimpleNamespace(warmup_steps=4, steps=16, temperature=0.0)
    timing = tune.time_decode_steps(llm, [[1] * 1023], batch, k, plan)
    assert len(timing.seconds) == 16
    assert timing.seconds == pytest.approx([0.01] * 16)  # consecutive steps, none skipped
    assert timing.tokens_per_step == pytest.approx(k + 1)
    assert not engine.requests  # aborted afterwards


def test_tokens_requested_cover_the_prefill_steps():
    config = types.SimpleNamespace(max_num_batched_tokens=8192)
    # 64 prompts of 1,023 tokens: 8 chunked prefill steps before the last request decodes.
    assert tune.tokens_to_request(21, 0, 64 * 1023, config) == 21 + 8 + 2
    assert tune.tokens_to_request(21, 7, 64 * 1023, config) == (21 + 8 + 2) * 8
    assert tune.tokens_to_request(21, 3, 100, config) == (21 + 1 + 2) * 4


@pytest.mark.parametrize(
    "schedule, said",
    [
        ([[1, 15, 7], [16, 63, 5], [64, 64, 3]], "16-63 (k=5), 64 and above (k=3)"),
        ([[1, 3, 7], [4, 4, 5], [5, 8, 7]], "4 (k=5) only"),
        ([(1, 3, 5), (4, 8, 3)], "4 and above (k=3)"),  # tuples, as a caller may pass them
        ([[1, 8, 7]], None),
        ([[1, 3, 7], [4, 8, 0]], None),  # k=0 is not a smaller block: plain decoding's note
    ],
)
def test_ranges_verifying_less_than_the_drafted_block_are_named(schedule, said):
    from vllm_nemotron_spec.bench.tune_report import smaller_k_lines

    top = max(k for _, _, k in schedule)
    lines = smaller_k_lines(schedule, top)
    if said is None:
        assert lines == []
    else:
        assert f"every step drafts the block of {top}; at batch sizes {said}" in lines[0]


def test_ks_that_draft_only_k_are_not_named_as_drafting_the_block(monkeypatch):
    """DSpark on the V2 runner drafts only k (patches/v2_dspark_draft_k.py): the engine says
    which k, the report records them and names only the others' ranges."""
    from vllm_nemotron_spec.bench import tune_report as tr

    schedule = [[1, 15, 7], [16, 63, 5], [64, 64, 3]]
    assert tr.smaller_k_lines(schedule, 7, (3, 5)) == []
    (line,) = tr.smaller_k_lines(schedule, 7, (5,))
    assert "at batch sizes 64 and above (k=3) only k are verified" in line
    m = _measurements()
    m.drafts_only_k = [1]
    report = _report(measurements=m)
    assert report["drafts_only_k"] == [1]
    monkeypatch.setattr("vllm_nemotron_spec.commands.serve_program", lambda: "vllm serve")
    text = tr.format_tune_report(report)
    assert "schedule serves it: k = 1 drafted and verified, other k: a block of 2" in text
    assert "only k are verified" not in text  # the worked example's k=1 range drafts 1
    assert _report()["drafts_only_k"] == []


def test_the_engine_says_which_k_draft_only_k():
    from vllm_nemotron_spec.patches.v2_dspark_draft_k import LAYOUTS

    class LLM:
        def __init__(self, workers):
            self.workers = workers

        def collective_rpc(self, fn):
            return [fn(w) for w in self.workers]

    def v2_worker(layouts=None):
        speculator = None if layouts is None else types.SimpleNamespace(**{LAYOUTS: layouts})
        return types.SimpleNamespace(model_runner=types.SimpleNamespace(speculator=speculator))

    def v1_worker(only_k):
        drafter = types.SimpleNamespace(drafts_only_k=only_k, block_num_speculative_tokens=4)
        return types.SimpleNamespace(model_runner=types.SimpleNamespace(drafter=drafter))

    two = [v2_worker({5: {}, 3: {}}), v2_worker({3: {}, 5: {}})]
    assert tune.engine_drafts_only_k(LLM(two)) == [3, 5]
    assert tune.engine_drafts_only_k(LLM([v2_worker({})])) == []  # DFlash, or no patch
    assert tune.engine_drafts_only_k(LLM([v1_worker(True)])) == [1, 2, 3]  # DSpark on V1
    assert tune.engine_drafts_only_k(LLM([v1_worker(False)])) == []  # DFlash on V1
    no_speculation = types.SimpleNamespace(model_runner=types.SimpleNamespace())
    assert tune.engine_drafts_only_k(LLM([no_speculation])) == []
