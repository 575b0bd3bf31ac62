"""A per-batch-size speculation schedule served with CUDA graphs on a hybrid target, vLLM 0.33.

With ``num_speculative_tokens_per_batch_size`` the V2 runner captures a full CUDA graph per k of
the schedule; vLLM's Mamba metadata builder refuses the capture of any k below
``num_speculative_tokens`` and the engine does not start. With the plugin's
``patches/mamba_schedule_graph_capture.py`` the fp32 DFlash and DSpark engines of the tiny family
start with full graphs, the batch shrinks 4 -> 3 -> 2 -> 1 through every k of the schedule (0
included), and the tokens equal plain decoding's (also with CUDA graphs); so do they with each k
of the schedule set for every batch size of the running engine (``tune``'s measurements). The
DSpark engine drafts only the step's k (``patches/v2_dspark_draft_k.py``): a layout and captured
graphs for each k between 0 and the block.
"""

from __future__ import annotations

import contextlib

import pytest

from tests.gpu import drafts
from tests.gpu.engines import V2_RUNNER, engine, engine_facts
from vllm_nemotron_spec import patches
from vllm_nemotron_spec.patches.engine_core_spec_tokens import set_engine_num_spec_tokens

BLOCK = 4
SCHEDULE = [[1, 1, 4], [2, 2, 2], [3, 3, 0], [4, 16, 1]]
LOOKUP = {1: 4, 2: 2, 3: 0, 4: 1}  # batch size -> k, read off SCHEDULE by hand
MAX_TOKENS = (12, 24, 40, 72)  # per prompt: the batch is 4, 3, 2, then 1 request
# Full CUDA graphs without torch.compile (vLLM drops the piecewise half of its default mode when
# compilation is off): the capture the patch is about, at a fraction of the engine start.
GRAPHS = dict(
    enforce_eager=False,
    compilation_config={"mode": 0, "cudagraph_mode": "FULL", "max_cudagraph_capture_size": 32},
)


@contextlib.contextmanager
def recorded_schedule(llm):
    """(batch size, k asked of the drafter) of every scheduler step of the in-process engine."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    original, steps = scheduler.schedule, []

    def schedule(*args, **kwargs):
        out = original(*args, **kwargs)
        if out.num_scheduled_tokens:
            steps.append((len(out.num_scheduled_tokens), out.num_spec_tokens_to_schedule))
        return out

    scheduler.schedule = schedule
    try:
        yield steps
    finally:
        scheduler.schedule = original


def _generate(llm, prompts):
    from vllm import SamplingParams

    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
    outputs = llm.generate(prompts[: len(MAX_TOKENS)], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def plain(tiny_family, prompts):
    with engine(tiny_family.target, None, "float32", **GRAPHS) as llm:
        return _generate(llm, prompts)


@pytest.fixture(scope="module", params=["dflash", "dspark"])
def scheduled(request, tiny_family, trained, prompts, tmp_path_factory):
    method = request.param
    twins = drafts.unquantized_twins(trained, tiny_family, tmp_path_factory.mktemp("twins"))
    spec = {"method": method, "model": str(twins[method]), "num_speculative_tokens": BLOCK,
            "num_speculative_tokens_per_batch_size": SCHEDULE}  # fmt: skip
    with engine(tiny_family.target, spec, "float32", **GRAPHS) as llm:
        config = llm.llm_engine.vllm_config.compilation_config
        with recorded_schedule(llm) as steps:
            tokens = _generate(llm, prompts)
        # tune's one engine for every k: each k of the schedule set for every batch size
        forced = {}
        for k in sorted(set(LOOKUP.values())):
            set_engine_num_spec_tokens(llm, k)
            with recorded_schedule(llm) as forced_steps:
                forced[k] = (_generate(llm, prompts), {s[1] for s in forced_steps})
        set_engine_num_spec_tokens(llm, None)
        (layouts,) = llm.collective_rpc(_draft_layouts_in_worker)
        return dict(method=method, tokens=tokens, steps=steps, facts=engine_facts(llm),
                    full_graphs=config.cudagraph_mode.has_full_cudagraphs(),
                    forced=forced, layouts=layouts)  # fmt: skip


def _draft_layouts_in_worker(worker) -> dict:
    """Per k layout of the speculator: its query tokens a request and the token counts of its
    captured graphs (runs inside the worker)."""
    from vllm_nemotron_spec.patches.v2_dspark_draft_k import LAYOUTS, manager_attr

    speculator = worker.model_runner.speculator
    layouts = getattr(speculator, LAYOUTS, {})
    managers = {k: getattr(speculator, manager_attr(k)) for k in layouts}
    return {
        k: (layout["num_query_per_req"], managers[k].captured_token_counts())
        for k, layout in layouts.items()
    }


def test_the_engine_starts_with_full_graphs_on_the_v2_runner(scheduled):
    assert patches.is_installed("mamba_schedule_graph_capture"), patches.state(
        "mamba_schedule_graph_capture"
    )
    assert scheduled["facts"].runner == V2_RUNNER
    assert scheduled["full_graphs"]


def test_every_k_of_the_schedule_ran(scheduled):
    asked = {(batch, k) for batch, k in scheduled["steps"]}
    assert {(b, LOOKUP[b]) for b in LOOKUP} <= asked, asked
    assert all(k == LOOKUP[min(batch, 4)] for batch, k in asked), asked


def test_tokens_equal_plain_decoding(scheduled, plain):
    bad = [i for i, (a, b) in enumerate(zip(plain, scheduled["tokens"])) if a != b]
    assert not bad, f"{scheduled['method']}: prompts {bad} differ from plain decoding"
    assert [len(t) for t in scheduled["tokens"]] == list(MAX_TOKENS)


def test_each_k_set_on_the_running_engine_runs_alone_and_exact(scheduled, plain):
    """``tune``'s measurements: every k of the schedule set for every batch size of the running
    engine (patches/engine_core_spec_tokens.py), replayed from its captured graphs."""
    for k, (tokens, asked) in scheduled["forced"].items():
        assert asked == {k}, (k, asked)
        assert tokens == plain, f"{scheduled['method']}, k={k}: tokens differ from plain decoding"


def test_dspark_drafts_only_the_steps_k(scheduled):
    """DSpark (causal block attention): each k strictly between 0 and the block has its own
    layout, 1 + k query tokens a request (the bonus anchor, ``sample_from_anchor: false`` as
    in Nemotron's drafts), with full graphs captured for them; DFlash (non-causal) keeps vLLM's
    whole block."""
    if scheduled["method"] == "dflash":
        assert scheduled["layouts"] == {}
        return
    assert patches.is_installed("v2_dspark_draft_k"), patches.state("v2_dspark_draft_k")
    layouts = scheduled["layouts"]
    assert sorted(layouts) == [1, 2]
    for k, (per_req, counts) in layouts.items():
        assert per_req == 1 + k
        assert counts and all(n % per_req == 0 for n in counts), (k, counts)
