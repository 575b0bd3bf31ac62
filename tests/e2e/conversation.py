"""A greedy multi-turn conversation on a served tiny family, with the prefix-cache hits of each turn.

Each turn's prompt is the previous turn's prompt, its answer and a new user message, so every
turn after the first can reuse the previous turns' KV blocks and Mamba checkpoints. The user
messages are corpus text, the same for every server, so servers can be compared turn for turn.
"""

from __future__ import annotations

import json

from vllm_nemotron_spec.bench import client as http
from vllm_nemotron_spec.bench import server as serve

BLOCK_TOKENS = 128
"""The tiny hybrid target's cache block on CPU (attention block = Mamba block in align mode)."""
FIRST_PROMPT_TOKENS = 300  # over two blocks
USER_TOKENS = 150
TURNS = 4
MAX_TOKENS = 24


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
    """The turns on one server (nothing else in flight there): prompts, answers, and the
    /metrics deltas of each turn."""
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
