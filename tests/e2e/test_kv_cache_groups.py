"""Drafts whose layers sit in several KV-cache groups draft exactly as in one group (V1 runner).

vLLM's hybrid KV-cache manager splits the attention layers of a NemotronH target + draft into
groups of equal size (``kv_cache_utils._get_kv_cache_groups_uniform_page_size``), each group with
its own block table. With the tiny target (2 attention + 6 Mamba blocks) the 6-layer DSpark
draft lands in 3 groups and the DFlash draft in 1. :func:`kv_cache_group_size` re-groups the
layers with a chosen group size, so the SAME draft runs once in one group and once in several:
tokens and every per-position acceptance count must be identical, and equal to plain decoding.
Prompts are longer than one attention KV block (128 tokens for the tiny target). Prefix caching
is left at vLLM's default (the plugin turns it off for NemotronH on CPU).
"""

from __future__ import annotations

import contextlib

import pytest

from vllm_nemotron_spec import runs

pytestmark = pytest.mark.engine

MAX_TOKENS = 24
PROMPT_LENGTHS = (40, 150, 260)  # tokens; the attention KV block of the tiny target is 128


@contextlib.contextmanager
def kv_cache_group_size(size: int, record: list):
    """Group each kind of layer into groups of ``size`` layers (vLLM interleaves a kind's layers
    over its groups the same way); the groups made are appended to ``record``."""
    from vllm.v1.core import kv_cache_utils as u

    original = u._get_kv_cache_groups_uniform_page_size

    def regroup(kv_cache_spec):
        kinds: dict = {}
        for name, spec in kv_cache_spec.items():
            kinds.setdefault(spec, []).append(name)
        grouped = []
        for names in kinds.values():
            n = -(-len(names) // size)
            grouped += [names[i::n] for i in range(n)]
        groups = u.create_kv_cache_group_specs(kv_cache_spec, grouped)
        record.append([list(g.layer_names) for g in groups])
        return groups

    u._get_kv_cache_groups_uniform_page_size = regroup
    try:
        yield
    finally:
        u._get_kv_cache_groups_uniform_page_size = original


@contextlib.contextmanager
def recorded_groups(record: list):
    """vLLM's own grouping, recorded."""
    from vllm.v1.core import kv_cache_utils as u

    original = u._get_kv_cache_groups_uniform_page_size

    def wrapped(kv_cache_spec):
        groups = original(kv_cache_spec)
        record.append([list(g.layer_names) for g in groups])
        return groups

    u._get_kv_cache_groups_uniform_page_size = wrapped
    try:
        yield
    finally:
        u._get_kv_cache_groups_uniform_page_size = original


def draft_group_count(groups: list[list[str]], num_target_layers: int) -> int:
    """How many groups hold draft layers (vLLM numbers draft layers after the target's)."""

    def is_draft(name: str) -> bool:
        parts = name.split(".")
        return "layers" in parts and int(parts[parts.index("layers") + 1]) >= num_target_layers

    return sum(any(is_draft(n) for n in g) for g in groups)


@pytest.fixture(scope="module")
def prompts(tiny_family):
    from vllm_nemotron_spec.tiny.corpus import document_windows
    from vllm_nemotron_spec.tiny.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_family.tokenizer)
    return [{"prompt_token_ids": w} for w in document_windows(tok, 2468, PROMPT_LENGTHS)]


@pytest.fixture(scope="module")
def plain(tiny_family, prompts):
    llm = runs.make_llm(str(tiny_family.target))
    try:
        return runs.generate(llm, prompts, MAX_TOKENS, "plain").token_ids
    finally:
        runs.release(llm)


@pytest.fixture(scope="module")
def two_layer_drafts(tiny_family, tmp_path_factory):
    from vllm_nemotron_spec.tiny.drafts import DraftParams, build_draft

    root = tmp_path_factory.mktemp("two-layer-drafts")
    params = DraftParams(num_hidden_layers=2)
    return {
        kind: build_draft(root / kind, kind, tiny_family.target, seed=3, params=params)
        for kind in ("dflash", "dspark")
    }


def _run(tiny_family, prompts, method, draft, k, grouping):
    record: list = []
    with grouping(record):
        llm = runs.make_llm(
            str(tiny_family.target),
            {"method": method, "model": str(draft), "num_speculative_tokens": k},
        )
    try:
        result = runs.generate(llm, prompts, MAX_TOKENS, method)
    finally:
        runs.release(llm)
    return result, record[-1]


def _num_target_layers(tiny_family) -> int:
    import json

    cfg = json.loads((tiny_family.target / "config.json").read_text())
    return len(cfg["hybrid_override_pattern"])


def _compare(tiny_family, prompts, plain, method, draft, k, sizes):
    """Run the draft with vLLM's grouping and with group size ``sizes``; both must be lossless,
    give identical acceptance, and between them cover one group and several."""
    n_target = _num_target_layers(tiny_family)
    default, default_groups = _run(tiny_family, prompts, method, draft, k, recorded_groups)
    forced, forced_groups = _run(
        tiny_family,
        prompts,
        method,
        draft,
        k,
        lambda record: kv_cache_group_size(sizes, record),
    )
    counts = sorted(
        (draft_group_count(default_groups, n_target), draft_group_count(forced_groups, n_target))
    )
    assert counts[0] == 1 and counts[1] >= 2, f"draft KV-cache group counts {counts}"
    assert default.token_ids == plain, f"{method}: vLLM's grouping is not lossless"
    assert forced.token_ids == plain, f"{method}: grouping of size {sizes} is not lossless"
    assert default.counters == forced.counters, (
        f"{method}: acceptance differs between {counts[0]} and {counts[1]} KV-cache groups: "
        f"{default.counters} vs {forced.counters}"
    )
    return default, forced


def test_dflash_trained_draft_one_group_vs_three(tiny_family, prompts, plain):
    from vllm_nemotron_spec.tiny.train_draft import ensure_trained_drafts

    draft = ensure_trained_drafts(seed=0, family=tiny_family).dflash
    default, _ = _compare(tiny_family, prompts, plain, "dflash", draft, 4, sizes=2)
    assert default.counters.mean_acceptance_length > 2.0  # a trained draft: the test can tell


def test_dspark_trained_draft_three_groups_vs_one(tiny_family, prompts, plain):
    from vllm_nemotron_spec.tiny.train_draft import ensure_trained_drafts

    draft = ensure_trained_drafts(seed=0, family=tiny_family).dspark
    default, _ = _compare(tiny_family, prompts, plain, "dspark", draft, 3, sizes=6)
    assert default.counters.mean_acceptance_length > 2.0


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_two_layer_drafts_one_group_vs_two(tiny_family, prompts, plain, two_layer_drafts, method):
    _compare(tiny_family, prompts, plain, method, two_layer_drafts[method], 3, sizes=1)
