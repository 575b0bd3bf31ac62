"""Fixtures shared by the engine tests: the trained tiny drafts and the test module's prompts."""

from __future__ import annotations

import pytest

PROMPT_DOCUMENT_SEED = 97531
"""Seed of the corpus windows the long prompts are cut from."""


@pytest.fixture(scope="module")
def trained(tiny_family):
    from vllm_nemotron_spec.tiny.train_draft import ensure_trained_drafts

    return ensure_trained_drafts(seed=0, family=tiny_family)


@pytest.fixture(scope="module")
def prompts(request, tiny_family):
    """Token-id prompts: the first ``NUM_SAMPLE_PROMPTS`` of the tiny family's sample prompts, then
    one corpus window per entry of ``LONG_PROMPT_LENGTHS`` (both set by the test module)."""
    from vllm_nemotron_spec.tiny.corpus import document_windows, sample_prompts
    from vllm_nemotron_spec.tiny.tokenizer import load_tokenizer

    module = request.module
    tok = load_tokenizer(tiny_family.tokenizer)
    out = [
        {"prompt_token_ids": tok.encode(p).ids}
        for p in sample_prompts()[: module.NUM_SAMPLE_PROMPTS]
    ]
    windows = document_windows(tok, PROMPT_DOCUMENT_SEED, module.LONG_PROMPT_LENGTHS)
    return out + [{"prompt_token_ids": w} for w in windows]
