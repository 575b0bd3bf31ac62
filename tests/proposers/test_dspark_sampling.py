"""Speculative sampling with the DSpark Markov walk preserves the target's distribution.

The draft side is the proposer's own :func:`markov_walk` with vLLM's draft sampler
(``compute_probs_and_sample_next_token``: q = softmax((U_k + Markov bias) / T)); the verifier is
vLLM's ``rejection_sample`` (accept x if u * q(x) < p(x), else a token from normalize(max(p - q,
0)), a bonus from p when everything is accepted). The target is a Markov chain over a tiny
vocabulary, so the exact law of the first emitted tokens is known: generation runs round after
round (draft gamma, verify, append what was emitted) until every trial has T tokens, and a
chi-square test compares the joint counts of those T tokens with the chain's probabilities.
A deliberately wrong verifier input (q of another temperature) must fail the same test, so the
test can tell.
"""

from __future__ import annotations

import math

import pytest
import torch

from vllm_nemotron_spec.proposers.dspark import markov_walk

VOCAB = 4
GAMMA = 3
NUM_TOKENS = 3  # joint law of the first 3 emitted tokens: 64 cells
TRIALS = 12000
TEMPERATURE = 0.8


class TinyMarkovDraft:
    """The two calls markov_walk makes on a DSpark model, with a random rank-2 Markov head."""

    def __init__(self, gen: torch.Generator):
        self.w1 = torch.randn(VOCAB, 2, generator=gen)
        self.w2 = torch.randn(VOCAB, 2, generator=gen)

    def markov_embed(self, token_ids):
        return self.w1[token_ids]

    def markov_bias(self, embed):
        return embed @ self.w2.T


def _sampling_metadata(batch: int):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    return SamplingMetadata(
        temperature=torch.full((batch,), TEMPERATURE),
        all_greedy=False,
        all_random=True,
        top_p=None,
        top_k=None,
        generators={},
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(batch),
        presence_penalties=torch.zeros(batch),
        repetition_penalties=torch.ones(batch),
        output_token_ids=[[] for _ in range(batch)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )


def _generate(target_logits, draft, base_logits, draft_temperature, seed):
    """TRIALS sequences of NUM_TOKENS tokens from anchor 0 by draft-then-verify rounds."""
    from vllm.v1.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID, rejection_sample
    from vllm.v1.spec_decode.llm_base_proposer import compute_probs_and_sample_next_token

    torch.manual_seed(seed)
    out = torch.full((TRIALS, NUM_TOKENS), -1, dtype=torch.long)
    filled = torch.zeros(TRIALS, dtype=torch.long)
    last = torch.zeros(TRIALS, dtype=torch.long)
    while (filled < NUM_TOKENS).any():
        meta = _sampling_metadata(TRIALS)
        draft_meta = _sampling_metadata(TRIALS)
        draft_meta.temperature = torch.full((TRIALS,), draft_temperature)

        def step(logits):
            return compute_probs_and_sample_next_token(logits, draft_meta)

        base = base_logits.expand(TRIALS, GAMMA, VOCAB).clone()
        ids, probs = markov_walk(draft, base, last, step)
        q = torch.stack(probs, dim=1).reshape(TRIALS * GAMMA, VOCAB).contiguous()
        prev = torch.cat([last[:, None], ids[:, :-1]], dim=1)  # the prefix each position sees
        p_logits = (target_logits[prev] / TEMPERATURE).reshape(TRIALS * GAMMA, VOCAB)
        bonus = torch.multinomial(torch.softmax(target_logits[ids[:, -1]] / TEMPERATURE, -1), 1).to(
            torch.int32
        )
        emitted = rejection_sample(
            ids.reshape(-1).to(torch.int32).contiguous(),
            [GAMMA] * TRIALS,
            GAMMA,
            torch.arange(1, TRIALS + 1, dtype=torch.int32) * GAMMA,
            q,
            p_logits.contiguous(),
            bonus.contiguous(),
            meta,
        )
        for j in range(GAMMA + 1):
            tok = emitted[:, j].long()
            take = (tok != PLACEHOLDER_TOKEN_ID) & (filled < NUM_TOKENS)
            out[take, filled[take]] = tok[take]
            last = torch.where(take, tok, last)
            filled += take.long()
            # a trial that emitted fewer tokens this round continues from its last one next round
    return out


def _chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square test; the survival function of chi2(k) is Q(k/2, x/2)."""
    expected = probs * counts.sum()
    keep = expected > 5  # pool the rare cells
    obs = torch.cat([counts[keep], counts[~keep].sum().view(1)])
    exp = torch.cat([expected[keep], expected[~keep].sum().view(1)])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = torch.tensor(float(len(obs) - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, stat / 2))


def _law(target_logits) -> torch.Tensor:
    """P(x1, x2, x3) of the chain from anchor 0 at TEMPERATURE, flattened."""
    p = torch.softmax(target_logits.double() / TEMPERATURE, -1)
    law = torch.einsum("a,ab,bc->abc", p[0], p, p)
    assert math.isclose(float(law.sum()), 1.0, rel_tol=1e-9)
    return law.reshape(-1)


@pytest.fixture(scope="module")
def setup():
    from vllm.platforms import current_platform

    if current_platform.is_cpu():  # the engine does this at start: CPU versions of vLLM's kernels
        current_platform.register_triton_kernel_overrides()
    gen = torch.Generator().manual_seed(7)
    target_logits = torch.randn(VOCAB, VOCAB, generator=gen) * 1.5
    base = torch.randn(1, GAMMA, VOCAB, generator=gen)
    return target_logits, TinyMarkovDraft(gen), base


def test_speculative_sampling_keeps_the_target_distribution(setup):
    target_logits, draft, base = setup
    out = _generate(target_logits, draft, base, TEMPERATURE, seed=1)
    codes = out[:, 0] * VOCAB * VOCAB + out[:, 1] * VOCAB + out[:, 2]
    counts = torch.bincount(codes, minlength=VOCAB**3).double()
    p_value = _chi_square_p_value(counts, _law(target_logits))
    assert p_value > 1e-3, f"emitted tokens do not follow the target's law (p={p_value:.2e})"


def test_the_check_detects_a_wrong_draft_distribution(setup):
    """q from another temperature than the one the draft sampled with: rejection sampling then
    divides by the wrong q and the law is off; the same check must see it."""
    target_logits, draft, base = setup
    out = _generate_with_mismatched_q(target_logits, draft, base)
    codes = out[:, 0] * VOCAB * VOCAB + out[:, 1] * VOCAB + out[:, 2]
    counts = torch.bincount(codes, minlength=VOCAB**3).double()
    assert _chi_square_p_value(counts, _law(target_logits)) < 1e-6


def _generate_with_mismatched_q(target_logits, draft, base):
    """Like _generate, but the draft samples at temperature 0.3 while the verifier is told q at
    TEMPERATURE."""
    from vllm.v1.spec_decode import llm_base_proposer

    real = llm_base_proposer.compute_probs_and_sample_next_token

    def sample_cold_report_warm(logits, meta, *args):
        warm = logits.clone()
        ids, _ = real(logits, _with_temperature(meta, 0.3))
        _, probs = real(warm, meta)
        return ids, probs

    llm_base_proposer.compute_probs_and_sample_next_token = sample_cold_report_warm
    try:
        return _generate(target_logits, draft, base, TEMPERATURE, seed=2)
    finally:
        llm_base_proposer.compute_probs_and_sample_next_token = real


def _with_temperature(meta, t):
    import dataclasses

    return dataclasses.replace(meta, temperature=torch.full_like(meta.temperature, t))


def test_greedy_walk_is_the_reference_walk():
    """The proposer's walk with a greedy step drafts, step by step, what the plain-torch reference
    walk (tiny/reference.py) drafts from the same base logits, anchors and Markov head."""
    from types import SimpleNamespace

    from vllm_nemotron_spec.tiny import reference as ref

    gen = torch.Generator().manual_seed(3)
    vocab, rank, gamma = 64, 8, 5
    head = ref.MarkovHead(vocab, rank, vocab)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    model = SimpleNamespace(markov_embed=head.markov_w1, markov_bias=head.markov_w2)
    base = 3 * torch.randn(6, gamma, vocab, generator=gen)
    anchors = torch.randint(0, vocab, (6,), generator=gen)
    with torch.no_grad():
        ids, probs = markov_walk(model, base, anchors, lambda x: (x.argmax(dim=-1), None))
        want, logits = ref.markov_walk(base, anchors, head.markov_w1.weight, head.markov_w2.weight)
    assert probs == [None] * gamma
    assert torch.equal(ids, want)
    # the bias matters: without it the drafts would be the base argmax
    assert not torch.equal(want, base.argmax(dim=-1))
