"""The routed Nemotron 3.5 DFlash and DSpark drafts under vLLM's model runner V2, in fp32.

vLLM 0.33 runs speculative decoding on CUDA through model runner V2: ``DFlashSpeculator`` and
``DSparkSpeculator`` (V2 only) load the draft class the plugin routes the checkpoint to. With the
tiny family's trained drafts (unquantized twins, so the engine runs in fp32): greedy tokens equal
plain decoding's on every prompt, the drafts are accepted as trained, and the wrong-layout
controls collapse to about one token per step (outputs still exact), which no working layout
gives. ``DSparkSpeculator`` calls the plugin draft's ``sample_sequential`` hook on every step.
"""

from __future__ import annotations

import pytest

from tests.gpu.checks import differing_prompts
from tests.gpu.engines import MAX_TOKENS, NUM_DFLASH_TOKENS, NUM_DSPARK_TOKENS, V2_RUNNER

# The same bars as the CPU engine tests (tests/e2e): a trained draft at 4 (DFlash) or 3 (DSpark)
# drafted tokens is accepted for 2.5 tokens per step or more (measured on the H200 in bf16: 3.51
# and 2.95-3.08); a draft read in the wrong layout predicts the token one position off, accepted
# only where the target repeats itself (1.08 and 1.15 there).
MIN_MEAN_ACCEPTANCE_LENGTH = 2.5
MAX_SHIFTED_MEAN_ACCEPTANCE_LENGTH = 1.3
MAX_WRONG_ANCHOR_MEAN_ACCEPTANCE_LENGTH = 1.5

DRAFTS = {
    # run: (speculator, the plugin's draft class, drafted tokens)
    "dflash": ("DFlashSpeculator", "Nemotron35DFlashForCausalLM", NUM_DFLASH_TOKENS),
    "dflash_shifted": ("DFlashSpeculator", "Nemotron35DFlashForCausalLM", NUM_DFLASH_TOKENS),
    "dspark": ("DSparkSpeculator", "Nemotron35DSparkForCausalLM", NUM_DSPARK_TOKENS),
    "dspark_wrong_anchor": ("DSparkSpeculator", "Nemotron35DSparkForCausalLM", NUM_DSPARK_TOKENS),
}


def test_plain_decoding_runs_on_model_runner_v2(fp32_runs):
    plain = fp32_runs["plain"]
    assert plain.facts.runner == V2_RUNNER
    assert plain.facts.speculator is None
    assert all(len(t) == MAX_TOKENS for t in plain.tokens)


@pytest.mark.parametrize("name", list(DRAFTS))
def test_draft_is_routed_to_the_plugins_class_under_v2(fp32_runs, name):
    speculator, draft_class, _ = DRAFTS[name]
    facts = fp32_runs[name].facts
    assert (facts.runner, facts.speculator, facts.draft_model) == (
        V2_RUNNER,
        speculator,
        draft_class,
    )
    assert facts.draft_quantization is None  # the unquantized twin, served in fp32
    assert facts.draft_backends, "the speculator built no attention group for the draft's layers"


@pytest.mark.parametrize("name", ["plain", *DRAFTS])
def test_mamba_builders_share_metadata_under_routed_drafts(fp32_runs, name):
    """With a routed draft on model runner V2 every Mamba builder of the target takes the first
    group's metadata (``patches/v2_mamba_group_metadata_reuse.py``); without a draft the patch
    leaves vLLM's builders alone. The tiny target's six Mamba layers form three KV-cache groups
    beside DSpark's draft layers (one beside DFlash's, seen on an H100): the lossless DSpark
    runs check steps whose later groups re-gathered their own state indices."""
    groups = fp32_runs[name].facts.mamba_groups
    assert groups and groups == [name != "plain"] * len(groups), groups
    if name.startswith("dspark"):
        assert len(groups) > 1, groups


@pytest.mark.parametrize("name", list(DRAFTS))
def test_greedy_speculative_decoding_is_lossless(fp32_runs, prompts, name):
    plain, run = fp32_runs["plain"], fp32_runs[name]
    bad = differing_prompts(plain.tokens, run.tokens)
    assert not bad, (
        f"{name}: (prompt, first differing output position) {bad} of {len(prompts)} prompts; "
        f"prompt lengths {[len(prompts[i]['prompt_token_ids']) for i, _ in bad]}"
    )


@pytest.mark.parametrize("name", ["dflash", "dspark"])
def test_trained_draft_is_accepted(fp32_runs, name):
    c = fp32_runs[name].counters
    k = DRAFTS[name][2]
    assert c.num_drafts > 0 and len(c.accepted_per_position) == k
    assert c.num_accepted_tokens <= c.num_draft_tokens
    assert c.mean_acceptance_length >= MIN_MEAN_ACCEPTANCE_LENGTH, (
        f"{name}: mean acceptance length {c.mean_acceptance_length:.3f} at {k} drafted tokens "
        f"(per position {[round(r, 3) for r in c.per_position_acceptance]})"
    )


@pytest.mark.parametrize(
    "right, wrong, most",
    [
        ("dflash", "dflash_shifted", MAX_SHIFTED_MEAN_ACCEPTANCE_LENGTH),
        ("dspark", "dspark_wrong_anchor", MAX_WRONG_ANCHOR_MEAN_ACCEPTANCE_LENGTH),
    ],
)
def test_wrong_layout_control_collapses_acceptance(fp32_runs, right, wrong, most):
    good = fp32_runs[right].counters.mean_acceptance_length
    bad = fp32_runs[wrong].counters.mean_acceptance_length
    assert bad is not None and bad <= most < good, (
        f"{wrong}: {bad}, {right}: {good} (a wrong layout must stay at or below {most})"
    )


def test_dspark_speculator_calls_the_plugins_markov_hook(fp32_runs, gpu_session):
    """``DSparkSpeculator._sample_sequential`` offers each step to the draft's
    ``sample_sequential``; the unquantized twin has no packed NVFP4 ``markov_w2`` for the fused
    walk (off anyway on GPUs other than Hopper), so the hook declines, logging why once, and
    vLLM's loop drafts."""
    from vllm_nemotron_spec.models.nemotron35_dspark import fused_walk_switch_reason

    choices = fp32_runs["dspark"].extra["walk_choices"]
    assert choices, "the plugin's DSpark draft was never asked to run the Markov walk"
    switched_off = fused_walk_switch_reason(1, gpu_session["capability"])
    if switched_off is not None:
        assert choices == {switched_off}, choices
    else:
        assert all(c is not None and "no packed NVFP4 markov_w2" in c for c in choices), choices


@pytest.mark.parametrize("name", ["plain", *DRAFTS])
def test_engine_caches_prefixes_in_align_mode(fp32_runs, name):
    run = fp32_runs[name]
    cache = run.extra["cache"]
    assert (cache["enable_prefix_caching"], cache["mamba_cache_mode"]) == (True, "align"), cache
    turn2 = run.extra["turn2"]
    assert turn2["hits"] > 0, (
        f"{name}: the second turn found none of its {turn2['queries']} prompt tokens in the "
        f"prefix cache (block size {cache['block_size']})"
    )


@pytest.mark.parametrize("name", list(DRAFTS))
def test_second_turn_on_cached_prefixes_is_lossless(fp32_runs, name):
    """Each prompt again with its answer and new user tokens: the prefix, generated tokens
    included, comes from the prefix cache (Mamba states at block boundaries, written while
    drafts were verified and rolled back)."""
    plain, run = fp32_runs["plain"].extra["turn2"], fp32_runs[name].extra["turn2"]
    bad = differing_prompts(plain["tokens"], run["tokens"])
    assert not bad, f"{name}, second turn: (prompt, first differing output position) {bad}"
