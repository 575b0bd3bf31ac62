"""The real vLLM CPU engine runs the tiny target and matches transformers token for token (fp32)."""

from __future__ import annotations

import gc

import pytest

from vllm_nemotron_spec.tiny import target as tg
from vllm_nemotron_spec.tiny.corpus import generate_documents
from vllm_nemotron_spec.tiny.tokenizer import load_tokenizer

pytestmark = pytest.mark.engine

MAX_NEW_TOKENS = 32


def _long_prompt(tok, min_tokens: int) -> str:
    docs = generate_documents(1234, 200)
    text = ""
    for doc in docs:
        text = f"{text} {doc}" if text else doc
        if len(tok.encode(text).ids) > min_tokens:
            return text
    raise AssertionError("corpus too short for the long prompt")


@pytest.fixture(scope="module")
def llm(tiny_family):
    pytest.importorskip("vllm")
    from vllm import LLM

    engine = LLM(
        model=str(tiny_family.target),
        dtype="float32",
        enforce_eager=True,
        enable_prefix_caching=False,  # tested on its own in tests/e2e/test_prefix_caching_serve.py
        max_model_len=512,
        seed=0,
    )
    yield engine
    del engine
    gc.collect()


@pytest.fixture(scope="module")
def prompts(tiny_family, llm):
    tok = load_tokenizer(tiny_family.tokenizer)
    block_size = llm.llm_engine.vllm_config.cache_config.block_size
    long = _long_prompt(tok, block_size + 16)  # longer than one KV-cache block
    return [
        "The small cat",
        "Days: monday, tuesday,",
        "Anna has a red dog. Q: What color is the dog? A:",
        long,
    ]


def test_vllm_greedy_matches_transformers(tiny_family, llm, prompts):
    from vllm import SamplingParams

    tok = load_tokenizer(tiny_family.tokenizer)
    block_size = llm.llm_engine.vllm_config.cache_config.block_size
    assert len(tok.encode(prompts[-1]).ids) > block_size

    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    model = tg.load_target(tiny_family.target)
    for prompt, out in zip(prompts, outputs):
        ids = tok.encode(prompt).ids
        assert list(out.prompt_token_ids) == ids  # vLLM tokenizes exactly like ours (BOS included)
        got = list(out.outputs[0].token_ids)
        expected = tg.greedy_reference(model, ids, MAX_NEW_TOKENS)
        assert got == expected, f"prompt {prompt[:40]!r}...: vLLM {got} != transformers {expected}"
        _assert_not_degenerate(got)


def test_vllm_output_is_structured_text(tiny_family, llm):
    from vllm import SamplingParams

    out = llm.generate(
        ["Days: monday, tuesday,"], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False
    )[0]
    assert out.outputs[0].text.startswith(" wednesday, thursday")
    assert llm.get_tokenizer().mask_token_id == 4


def _assert_not_degenerate(tokens: list[int]) -> None:
    assert len(set(tokens)) >= 4, f"output uses fewer than 4 distinct tokens: {tokens}"
    run = longest = 1
    for a, b in zip(tokens, tokens[1:]):
        run = run + 1 if a == b else 1
        longest = max(longest, run)
    assert longest < 6, f"one token repeated {longest} times in a row: {tokens}"
