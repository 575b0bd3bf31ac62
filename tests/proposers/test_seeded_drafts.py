"""Probabilistic drafts honour request seeds (``proposers.dflash.resample_seeded_rows``): vLLM's V1
drafting draws its noise from the global RNG, so a seeded request's drafts (and output) changed
from run to run."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from vllm_nemotron_spec.proposers.dflash import resample_seeded_rows

V = 6


def _metadata(temperatures, seeds):
    generators = {i: torch.Generator().manual_seed(s) for i, s in seeds.items()}
    return SimpleNamespace(
        all_greedy=False, temperature=torch.tensor(temperatures), generators=generators
    )


def _probs(rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(rows, V, generator=g) * 2, dim=-1)


def test_seeded_rows_repeat_and_unseeded_rows_are_left_alone():
    probs = _probs(2 * 3)  # 2 requests x 3 draft rows (DFlash: request-major)
    ids = torch.full((6,), -1)
    a = resample_seeded_rows(ids.clone(), probs, _metadata([0.7, 0.7], {1: 42}))
    b = resample_seeded_rows(ids.clone(), probs, _metadata([0.7, 0.7], {1: 42}))
    assert torch.equal(a, b)
    assert (a[:3] == -1).all(), "request 0 has no seed: vLLM's draw stays"
    assert (a[3:] >= 0).all()
    different = [
        resample_seeded_rows(ids.clone(), probs, _metadata([0.7, 0.7], {1: s}))[3:]
        for s in range(20)
    ]
    assert len({tuple(x.tolist()) for x in different}) > 1, "the seed must matter"


def test_greedy_requests_and_unseeded_batches_are_unchanged():
    probs = _probs(2)
    ids = torch.tensor([5, 5])
    out = resample_seeded_rows(ids.clone(), probs, _metadata([0.0, 0.7], {0: 1}))
    assert out[0] == 5, "a greedy request keeps its argmax even with a seed"
    assert torch.equal(resample_seeded_rows(ids.clone(), probs, _metadata([0.7, 0.7], {})), ids)
    greedy = SimpleNamespace(all_greedy=True, temperature=None, generators={0: torch.Generator()})
    assert torch.equal(resample_seeded_rows(ids.clone(), probs, greedy), ids)


def test_seeded_draws_follow_the_draft_distribution():
    probs = _probs(1, seed=3)
    n = 4000
    counts = torch.zeros(V)
    for s in range(n):
        out = resample_seeded_rows(
            torch.zeros(1, dtype=torch.long), probs, _metadata([1.0], {0: s})
        )
        counts[out[0]] += 1
    expected = probs[0] * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 30.0, (chi2, counts.tolist(), expected.tolist())  # 5 dof: p ~ 1.5e-5
