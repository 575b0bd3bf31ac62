"""Per-batch-size speculation (``num_speculative_tokens_per_batch_size``) on the plugin's V1
proposers, and ``tune`` end to end, in the real vLLM CPU engine with the trained tiny drafts.

Four prompts with different ``max_tokens`` (``ignore_eos``) finish one after another, so the
batch shrinks 4 -> 3 -> 2 -> 1 and the schedule changes k at each step down, through a phase of
k = 0. vLLM's scheduler picks k from the batch size of each step; the drafts the proposer makes
in that step are verified in the next one. fp32, eager, greedy: tokens must equal plain
decoding's, and every verified step must carry exactly the k the schedule gives.
"""

from __future__ import annotations

import contextlib
import io
import json
import types

import pytest

from vllm_nemotron_spec import runs

pytestmark = pytest.mark.engine

NUM_SAMPLE_PROMPTS = 3  # then the long prompt (the conftest's `prompts`)
LONG_PROMPT_LENGTHS = (70,)
MAX_TOKENS = (12, 24, 40, 72)  # per prompt: the batch is 4, 3, 2, then 1 request
BLOCK = 4  # num_speculative_tokens: the block drafted every step
SCHEDULE = [[1, 1, 4], [2, 2, 2], [3, 3, 0], [4, 16, 1]]
LOOKUP = {1: 4, 2: 2, 3: 0, 4: 1}  # batch size -> k, read off SCHEDULE by hand


@contextlib.contextmanager
def record_schedule(llm):
    """Every scheduler step of the in-process engine: (batch size, k the drafter is asked for,
    {request: drafts verified this step})."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    original = scheduler.schedule
    steps = []

    def schedule(*args, **kwargs):
        out = original(*args, **kwargs)
        if out.num_scheduled_tokens:
            steps.append(
                (
                    len(out.num_scheduled_tokens),
                    out.num_spec_tokens_to_schedule,
                    {r: len(t) for r, t in out.scheduled_spec_decode_tokens.items()},
                    set(out.num_scheduled_tokens),
                )
            )
        return out

    scheduler.schedule = schedule
    try:
        yield steps
    finally:
        scheduler.schedule = original


def _generate(llm, prompts, max_tokens=MAX_TOKENS):
    """Greedy, ignore_eos, one max_tokens per prompt: (tokens, counters)."""
    from vllm import SamplingParams

    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
    before = runs.read_spec_counters(llm)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    counters = runs.read_spec_counters(llm).minus(before)
    return [list(o.outputs[0].token_ids) for o in outputs], counters


@pytest.fixture(scope="module")
def plain(tiny_family, prompts):
    runs.set_engine_defaults()
    llm = runs.make_llm(str(tiny_family.target), enable_prefix_caching=False)
    try:
        return _generate(llm, prompts)[0]
    finally:
        runs.release(llm)


def _scheduled_engine(tiny_family, trained, method):
    """The method's engine with the schedule."""
    spec = {
        "method": method,
        "model": str(getattr(trained, method)),
        "num_speculative_tokens": BLOCK,
        "num_speculative_tokens_per_batch_size": SCHEDULE,
    }
    return runs.make_llm(str(tiny_family.target), spec, enable_prefix_caching=False)


def _scheduled_run(llm, method, prompts):
    """The prompts on an engine of :func:`_scheduled_engine`: tokens, counters, recorded steps,
    proposer."""
    core = llm.llm_engine.engine_core.engine_core
    drafter = core.model_executor.driver_worker.worker.model_runner.drafter
    with record_schedule(llm) as steps, record_drafting(drafter) as calls:
        tokens, counters = _generate(llm, prompts)
    return types.SimpleNamespace(
        method=method,
        tokens=tokens,
        counters=counters,
        steps=steps,
        calls=calls,
        proposer=type(drafter).__name__,
        lookup=list(core.scheduler.dynamic_sd_lookup or []),
    )


@pytest.fixture(scope="module")
def dspark_engine_runs(tiny_family, trained, prompts):
    """The DSpark engine with the schedule, started once for two uses: first its run for
    ``scheduled``, then the same batch drafting the whole block and drafting only k
    (:func:`_drafts_only_k_runs`)."""
    llm = _scheduled_engine(tiny_family, trained, "dspark")
    try:
        return _scheduled_run(llm, "dspark", prompts), _drafts_only_k_runs(llm, prompts)
    finally:
        runs.release(llm)


@pytest.fixture(scope="module", params=["dflash", "dspark"])
def scheduled(request, tiny_family, trained, prompts):
    """One engine per method with the schedule: tokens, counters, recorded steps, proposer."""
    method = request.param
    if method == "dspark":
        return request.getfixturevalue("dspark_engine_runs")[0]
    llm = _scheduled_engine(tiny_family, trained, method)
    try:
        return _scheduled_run(llm, method, prompts)
    finally:
        runs.release(llm)


@contextlib.contextmanager
def record_drafting(drafter):
    """Each ``propose`` call of the proposer: the k asked for, the batch, the target positions
    handed over, the positions whose context K/V the draft stored, the query rows of each draft
    forward, and the shape of the drafts returned."""
    calls = []
    model = drafter.model
    propose, store, forward = drafter.propose, model.precompute_and_store_context_kv, model.forward

    def recording_propose(**kwargs):
        call = dict(
            k=int(kwargs["num_speculative_tokens"]),
            batch=int(kwargs["next_token_ids"].shape[0]),
            positions=kwargs["target_positions"].tolist(),
            stored=[],
            query_rows=[],
        )
        calls.append(call)
        drafts = propose(**kwargs)
        call["drafts_shape"] = tuple(drafts.shape)
        return drafts

    def recording_store(hidden_states, positions, *args, **kwargs):
        calls[-1]["stored"].append(positions.tolist())
        return store(hidden_states, positions, *args, **kwargs)

    def recording_forward(*args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        calls[-1]["query_rows"].append(int(ids.shape[0]))
        return forward(*args, **kwargs)

    drafter.propose = recording_propose
    model.precompute_and_store_context_kv = recording_store
    model.forward = recording_forward
    try:
        yield calls
    finally:
        del drafter.propose, model.precompute_and_store_context_kv, model.forward


def test_the_schedule_reaches_the_plugins_proposer(scheduled):
    expected = {"dflash": "Nemotron35DFlashProposer", "dspark": "Nemotron35DSparkProposer"}
    assert scheduled.proposer == expected[scheduled.method]
    assert scheduled.lookup[1:5] == [LOOKUP[b] for b in (1, 2, 3, 4)]


def test_tokens_equal_plain_decoding(scheduled, plain):
    bad = [i for i, (a, b) in enumerate(zip(plain, scheduled.tokens)) if a != b]
    assert not bad, f"{scheduled.method}: prompts {bad} differ from plain decoding"
    assert [len(t) for t in scheduled.tokens] == list(MAX_TOKENS)


def test_every_step_verifies_the_k_of_the_previous_batch_size(scheduled):
    """The drafts verified for a request in step n+1 are the k the schedule gives for step n's
    batch size: what the scheduler asked the proposer for, no more, no less."""
    steps = scheduled.steps
    checked = {}
    for (batch, asked, _, reqs), (_, _, verified, next_reqs) in zip(steps, steps[1:]):
        assert asked == LOOKUP[batch], (batch, asked)
        for req in reqs & next_reqs:
            assert verified.get(req, 0) == LOOKUP[batch], (req, batch, verified)
            checked[batch] = checked.get(batch, 0) + 1
    # every phase of the schedule was crossed (4 -> 3 -> 2 -> 1), each for several steps
    assert set(checked) == {1, 2, 3, 4} and min(checked.values()) >= 3, checked


def test_counters_count_exactly_the_scheduled_drafts(scheduled):
    """vLLM's spec-decode counters agree with the recorded schedule: drafted tokens and drafting
    steps are those of the verified steps, and positions 2..4 were drafted only at batch 1."""
    c = scheduled.counters
    verified = [n for _, _, v, _ in scheduled.steps for n in v.values() if n]
    assert c.num_draft_tokens == sum(verified)
    assert c.num_drafts == len(verified)
    assert len(c.accepted_per_position) == BLOCK
    assert c.num_accepted_tokens == sum(c.accepted_per_position)


def test_dflash_drafts_the_whole_block_and_dspark_only_k(scheduled):
    """DFlash (attends across its block) runs the draft on the whole block (``BLOCK`` drafts a
    request) and returns the first k; DSpark (causal) runs it on k drafts; a k = 0 step runs no
    draft forward."""
    for call in scheduled.calls:
        assert call["drafts_shape"] == (call["batch"], call["k"]), call["drafts_shape"]
        drafted = BLOCK if scheduled.method == "dflash" else call["k"]
        rows = 1 + drafted  # [b, MASK x drafted]: both tiny drafts keep the bonus anchor row
        expected = [] if call["k"] == 0 else [call["batch"] * rows]
        assert call["query_rows"] == expected, call
    assert {c["k"] for c in scheduled.calls} == {0, 1, 2, 4}


def test_steps_without_drafts_still_store_the_context(scheduled):
    """A k = 0 step stores the committed tokens' context K/V like a drafting step (later drafts
    attend to them): each call stored exactly the positions the target handed over."""
    assert any(c["k"] == 0 for c in scheduled.calls)
    for call in scheduled.calls:
        assert call["stored"] == [call["positions"]], call["k"]


def test_a_step_asking_for_more_than_the_block_is_refused():
    from vllm_nemotron_spec.proposers.dflash import Nemotron35DFlashProposer

    with pytest.raises(ValueError, match=r"expected 0\.\.4 .*found 5"):
        Nemotron35DFlashProposer.propose(types.SimpleNamespace(block_num_speculative_tokens=4), 5)


# --------------------------------------------------------------------------------------------
# tune, end to end: it measures, writes a schedule, and the schedule serves exact tokens.


@pytest.fixture(scope="module")
def tuned(tiny_family, trained, tmp_path_factory):
    from vllm_nemotron_spec.cli.main import main

    out_dir = tmp_path_factory.mktemp("tune")
    schedule = out_dir / "schedule.json"
    argv = [
        "tune",
        str(tiny_family.target),
        "--method",
        "dspark",
        "--draft",
        str(trained.dspark),
        "--k",
        "1,2",
        "--max-batch",
        "2",
        "--steps",
        "3",
        "--warmup-steps",
        "1",
        "--max-tokens",
        "24",
        "--temperature",
        "0.7",
        "--no-plain",
        "--out",
        str(schedule),
        "--json",
    ]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return types.SimpleNamespace(
        code=code, report=json.loads(out.getvalue()), stderr=err.getvalue(), schedule=schedule
    )


TUNE_KS = (1, 2)
TUNE_BATCHES = (1, 2)


def test_tune_measures_every_batch_size_and_k(tuned):
    report = tuned.report
    assert tuned.code == 0, tuned.stderr[-2000:]
    assert report["schema"] == "vllm-nemotron-spec.tune/5"
    assert report["drafts_only_k"] == [1]  # DSpark drafts k; k=2 is the block
    assert report["ks"] == list(TUNE_KS) and report["batch_sizes"] == list(TUNE_BATCHES)
    cells = {(m["batch"], m["k"]): m for m in report["measurements"]}
    assert set(cells) == {(b, k) for b in TUNE_BATCHES for k in TUNE_KS}
    for (b, k), m in cells.items():
        assert m["steps"] == 3 and m["step_ms"] > 0
        q1, q3 = m["step_ms_quartiles"]
        assert q1 <= m["step_ms"] <= q3
        assert 1.0 <= m["measured_tokens_per_step"] <= k + 1
    # --no-plain: no plain-decoding engine (on CPU it would win: the tiny draft costs as much as
    # the tiny target, and tune would write no schedule to serve below)
    assert report["plain"] is None and report["plain_engine_start_s"] is None
    # greedy and at the user's temperature, both at the largest k; the schedule uses the latter
    assert report["acceptance_used"] == "sampled" and report["temperature"] == 0.7
    assert set(report["acceptance"]) == {"greedy", "sampled"}
    for acc in report["acceptance"].values():
        assert len(acc["per_position_acceptance"]) == max(TUNE_KS)
        assert acc["num_drafts"] > 0
        assert acc["num_accepted_tokens"] == sum(acc["accepted_per_position"])


def test_tune_derives_rates_and_schedule_from_its_measurements(tuned):
    """The expected tokens/s, the choice and the ranges follow from the reported numbers."""
    from vllm_nemotron_spec.bench.schedule import choose_schedule, merge_ranges

    report = tuned.report
    rates = report["acceptance"]["sampled"]["per_position_acceptance"]
    expected_accepted = {0: 0.0, 1: rates[0], 2: rates[0] + rates[1]}
    rate = {}
    for m in report["measurements"]:
        b, k = m["batch"], m["k"]
        assert report["expected_accepted"][str(k)] == pytest.approx(expected_accepted[k], abs=1e-3)
        want = b * (1 + expected_accepted[k]) / (m["step_ms"] / 1000)
        assert m["expected_tokens_per_s"] == pytest.approx(want, rel=1e-3)
        rate[(b, k)] = m["expected_tokens_per_s"]
    choice = choose_schedule(rate)
    assert {c["batch"]: c["k"] for c in report["chosen"]} == choice
    assert report["schedule"] == merge_ranges(choice)
    config = report["speculative_config"]
    assert report["block"] == max(TUNE_KS)
    assert config["method"] == "dspark" and config["model"] == report["draft"]
    assert config["num_speculative_tokens"] == max(choice.values())
    assert config["num_speculative_tokens_per_batch_size"] == report["schedule"]
    assert json.loads(tuned.schedule.read_text()) == config
    assert report["schedule_file"] == str(tuned.schedule)


def test_tune_reports_progress_with_an_eta(tuned):
    """One line for the engine start and one per measurement, numbered, each with an ETA."""
    lines = [line for line in tuned.stderr.splitlines() if line.startswith("tune [")]
    total = 1 + len(TUNE_KS) * len(TUNE_BATCHES) + 2  # the start, timings, acceptance x 2
    assert [line.split("]")[0] for line in lines] == [
        f"tune [{i}/{total}" for i in range(1, total + 1)
    ]
    assert all("ETA" in line for line in lines[:-1]) and lines[-1].endswith("done)")


def test_the_tuned_schedule_serves_plain_decodings_tokens(tuned, tiny_family, prompts, plain):
    """The file tune wrote, served as is with the engine settings its report prints: tokens
    equal plain decoding's while the batch shrinks from 4 to 1 (the schedule's last range
    carries to the larger batches)."""
    config = json.loads(tuned.schedule.read_text())
    # the CPU engine tune measured: runs.make_llm's small-model settings, prefix caching off
    settings = dict(dtype="float32", enforce_eager=True, max_model_len=512)
    assert tuned.report["engine_args"] == dict(settings, enable_prefix_caching=False)
    llm = runs.make_llm(str(tiny_family.target), config, **tuned.report["engine_args"])
    try:
        tokens, counters = _generate(llm, prompts)
    finally:
        runs.release(llm)
    assert tokens == plain
    assert counters.num_drafts > 0


def test_tune_times_every_k_while_a_batch_prefills_in_chunks(tiny_family, trained, tmp_path):
    """With a small ``max_num_batched_tokens`` a batch's prompts prefill over several steps while
    its first request already decodes; at k=0 and in plain decoding (one token a step) the
    requests must still outlast the timed steps."""
    from vllm_nemotron_spec.cli.main import main

    words = " ".join(["the quick brown fox jumps over the lazy dog"] * 6)  # ~60 tokens
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i} {words}"}) + "\n" for i in range(2)))
    argv = ["tune", str(tiny_family.target), "--method", "dspark", "--draft", str(trained.dspark),
            "--prompts", str(prompts), "--k", "0,1", "--max-batch", "2", "--steps", "3",
            "--warmup-steps", "1", "--max-tokens", "16", "--no-progress", "--json",
            "--engine-arg", "max_num_batched_tokens=40",
            "--engine-arg", "enable_prefix_caching=false"]  # fmt: skip
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    assert code == 0, err.getvalue()[-2000:]
    report = json.loads(out.getvalue())
    cells = {(m["batch"], m["k"]): m for m in report["measurements"]}
    assert set(cells) == {(b, k) for b in (1, 2) for k in (0, 1)}
    assert cells[(2, 0)]["steps"] == 3 and cells[(2, 0)]["measured_tokens_per_step"] == 1.0
    # plain decoding, timed in a second engine without speculation: one token a request a step
    plain = {p["batch"]: p for p in report["plain"]}
    assert set(plain) == {1, 2} and report["plain_engine_start_s"] > 0
    for p in plain.values():
        assert p["steps"] == 3 and p["measured_tokens_per_step"] == 1.0
        assert p["tokens_per_s"] == pytest.approx(p["batch"] / (p["step_ms"] / 1000), rel=1e-3)
    assert [c["speedup_vs_plain"] > 0 for c in report["chosen"]] == [True, True]


# --------------------------------------------------------------------------------------------
# A running engine's k, set from the client (patches/engine_core_spec_tokens.py), with the engine
# core in vLLM's own process as on a GPU: tune's one engine for every k.


def test_the_k_of_a_running_engine_is_set_in_its_engine_core_process(
    tiny_family, trained, prompts, plain, monkeypatch
):
    from vllm_nemotron_spec.patches.engine_core_spec_tokens import set_engine_num_spec_tokens

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    spec = {"method": "dspark", "model": str(trained.dspark), "num_speculative_tokens": 2,
            "num_speculative_tokens_per_batch_size": [[1, 1, 0], [2, 16, 2]]}  # fmt: skip
    llm = runs.make_llm(str(tiny_family.target), spec, enable_prefix_caching=False)
    try:
        assert type(llm.llm_engine.engine_core).__name__ == "SyncMPClient"
        n = MAX_TOKENS[-1]
        one = [prompts[-1]]  # a batch of one: the schedule it started with says k = 0
        started = _generate(llm, one, (n,))
        assert set_engine_num_spec_tokens(llm, 2) == [0, 2]
        forced = _generate(llm, one, (n,))
        with pytest.raises(Exception, match=r"k=1 is not in the engine's schedule"):
            set_engine_num_spec_tokens(llm, 1)
        set_engine_num_spec_tokens(llm, None)
        restored = _generate(llm, one, (n,))
    finally:
        runs.release(llm)
    for tokens, _ in (started, forced, restored):
        assert tokens == [plain[-1]]
    assert started[1].num_draft_tokens == 0 and restored[1].num_draft_tokens == 0
    assert forced[1].num_drafts > 0
    assert forced[1].num_draft_tokens == 2 * forced[1].num_drafts


def _drafts_only_k_runs(llm, prompts) -> dict:
    """On a DSpark engine of :func:`_scheduled_engine`: the prompts drafting the whole block and
    cutting it to k, then drafting only k. ``{"default": the drafter's own setting, only_k:
    (tokens, counters, each step's drafts, recorded proposer calls)}``."""
    core = llm.llm_engine.engine_core.engine_core
    drafter = core.model_executor.driver_worker.worker.model_runner.drafter
    runs_by_mode = {"default": drafter.drafts_only_k}
    for only_k in (False, True):
        drafter.drafts_only_k = only_k
        with record_drafting(drafter) as calls:
            recording, drafts = drafter.propose, []

            def propose(**kwargs):
                out = recording(**kwargs)
                drafts.append(out.tolist())
                return out

            drafter.propose = propose
            tokens, counters = _generate(llm, prompts)
        runs_by_mode[only_k] = (tokens, counters, drafts, calls)
    return runs_by_mode


def test_dspark_drafting_only_k_drafts_what_the_block_drafted(dspark_engine_runs, plain):
    """The premise of drafting only k: with causal block attention a step's first k drafts are
    the block's. The same schedule, drafting the whole block and cutting it to k, then drafting
    only k: every step's drafts are the same tokens (with DFlash, which attends across its
    block, some steps' drafts differ), and so are the outputs (plain decoding's) and the
    accepted drafts at every position. (On the engine of ``scheduled``'s DSpark run, after it.)"""
    runs_by_mode = dspark_engine_runs[1]
    assert runs_by_mode["default"]  # the DSpark draft's attention is causal
    (t_block, c_block, d_block, calls_block), (t_k, c_k, d_k, calls_k) = (
        runs_by_mode[False],
        runs_by_mode[True],
    )
    assert d_k == d_block and any(any(row) for row in d_k)
    # the query pass really differed: [b, MASK x k] rows against [b, MASK x BLOCK]
    assert [c["query_rows"] for c in calls_k] != [c["query_rows"] for c in calls_block]
    assert t_k == t_block == plain
    assert c_k.accepted_per_position == c_block.accepted_per_position
    assert (c_k.num_drafts, c_k.num_draft_tokens) == (c_block.num_drafts, c_block.num_draft_tokens)
