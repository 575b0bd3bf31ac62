"""Quantized drafts in the real vLLM CPU engine, through the plugin: lossless, and accepted within
0.1 tokens per step of the BF16 draft they were made from.

The BF16 draft is the trained tiny DFlash draft's BF16 twin (``dflash_unquantized``); it is
quantized with ``quantize --engine builtin``, with ``--engine modelopt`` (where nvidia-modelopt is
available) and with the compressed-tensors library (``nvfp4-pack-quantized``). Same prompts,
gamma and settings as ``tests/e2e/test_dflash_engine.py`` (fp32, eager, greedy, ``ignore_eos``).
"""

from __future__ import annotations

import pytest

from vllm_nemotron_spec import runs

pytestmark = pytest.mark.engine

NUM_SPECULATIVE_TOKENS = 4
MAX_TOKENS = 48
MAX_ACCEPTANCE_LOSS = 0.1
"""Tokens per step a quantized draft may lose against its BF16 source."""

LONG_PROMPT_LENGTHS = (60, 100, 150)

_cache: dict = {}


@pytest.fixture(scope="module")
def prompts(tiny_family):
    """The prompts of tests/e2e/test_dflash_engine.py: the corpus-style sample prompts plus three
    windows of unseen corpus documents (60, 100 and 150 tokens), as token ids."""
    from vllm_nemotron_spec.tiny.corpus import generate_documents, sample_prompts
    from vllm_nemotron_spec.tiny.tokenizer import BOS_ID, EOS_ID, load_tokenizer

    tok = load_tokenizer(tiny_family.tokenizer)
    out = [{"prompt_token_ids": tok.encode(p).ids} for p in sample_prompts()]
    stream: list[int] = []
    for enc in tok.encode_batch(generate_documents(4321, 300)):
        stream += enc.ids + [EOS_ID]
    end = 0
    for length in LONG_PROMPT_LENGTHS:
        start = stream.index(BOS_ID, end)
        end = start + length
        out.append({"prompt_token_ids": stream[start:end]})
    return out


def _run(tiny_family, prompts, name: str, draft):
    """Tokens, spec-decode counters and the draft's quantization method of one engine (cached for
    the module: each configuration starts one engine)."""
    if name not in _cache:
        runs.set_engine_defaults()
        spec = None
        if draft is not None:
            spec = {
                "method": "dflash",
                "model": str(draft),
                "num_speculative_tokens": NUM_SPECULATIVE_TOKENS,
            }
        llm = runs.make_llm(str(tiny_family.target), spec, enable_prefix_caching=False)
        try:
            result = runs.generate(llm, prompts, MAX_TOKENS, name)
            spec_config = llm.llm_engine.vllm_config.speculative_config
            quant = spec_config.draft_model_config.quantization if spec_config else None
        finally:
            runs.release(llm)
        _cache[name] = (result.token_ids, result.counters, quant)
    return _cache[name]


@pytest.fixture(scope="module")
def plain(tiny_family, prompts):
    return _run(tiny_family, prompts, "plain", None)


@pytest.fixture(scope="module")
def bf16(tiny_family, prompts, bf16_dflash):
    return _run(tiny_family, prompts, "bf16", bf16_dflash)


@pytest.fixture(scope="module", params=["builtin", "modelopt", "compressed-tensors"])
def quantized(request, tiny_family, prompts):
    from vllm_nemotron_spec.nvfp4 import compressed_tensors as ct
    from vllm_nemotron_spec.nvfp4.config import NAME

    if request.param == "builtin":
        draft, expected = request.getfixturevalue("builtin_dflash"), NAME
    elif request.param == "modelopt":
        draft, expected = request.getfixturevalue("modelopt_dflash"), NAME
    else:
        draft, expected = request.getfixturevalue("ct_dflash"), ct.NAME
        _assert_startup_check_accepts(draft)
    return request.param, _run(tiny_family, prompts, request.param, draft), expected


def _assert_startup_check_accepts(draft) -> None:
    """The plugin's start-up check (``checkpoint.check``) lets the compressed-tensors draft through
    to vLLM (its tensor layout is not checked there; the quantization config itself is tested in
    test_compressed_tensors.py)."""
    from vllm_nemotron_spec.checkpoint.check import check_draft

    problems = check_draft(str(draft)).problems
    assert not problems, (
        f"the start-up check refuses the compressed-tensors draft ({len(problems)} problems, "
        f"e.g. {problems[0]!r})"
    )


def _same_tokens(prompts, expected, got, name):
    for i, (a, b) in enumerate(zip(expected, got)):
        if a != b:
            first = next(k for k, (x, y) in enumerate(zip(a, b)) if x != y)
            pytest.fail(f"{name}: prompt {i} differs from plain decoding at output token {first}")


def test_bf16_draft_is_served_unquantized_and_lossless(plain, bf16, prompts):
    tokens, counters, quant = bf16
    assert quant is None
    _same_tokens(prompts, plain[0], tokens, "bf16")
    assert counters.num_drafts > 0


def test_quantized_draft_is_served_quantized_and_lossless(plain, quantized, prompts):
    name, (tokens, counters, quant), expected = quantized
    assert quant == expected
    _same_tokens(prompts, plain[0], tokens, name)
    assert counters.num_drafts > 0


def test_quantized_acceptance_is_within_0_1_of_bf16(bf16, quantized):
    name, (_, counters, _), _ = quantized
    reference = bf16[1]
    got, want = counters.mean_acceptance_length, reference.mean_acceptance_length
    detail = (
        f"{name}: mean acceptance length {got:.3f} (per position "
        f"{[round(r, 3) for r in counters.per_position_acceptance]}, {counters.num_drafts} "
        f"drafts) vs BF16 {want:.3f} (per position "
        f"{[round(r, 3) for r in reference.per_position_acceptance]}, "
        f"{reference.num_drafts} drafts)"
    )
    print(detail)
    assert want > 2.5, detail  # the BF16 draft itself works
    assert abs(got - want) <= MAX_ACCEPTANCE_LOSS, detail
