"""Scale-out: two TP=1 ``vllm serve`` replicas with a routed Nemotron 3.5 DSpark draft behind
vLLM's router (``vllm-router``, a test dependency), CPU, tiny family, 127.0.0.1 only.

Three servers run for the module, started together: two speculative replicas (the trained tiny
DSpark draft, prefix caching in Mamba align mode, vLLM KV events published on a loopback port)
and a plain one, the reference (plain decoding, each request alone). Routers are cheap (under a
second to start): each policy gets its own ``vllm-router`` process in front of the same two
replicas. Checked through the router:

- every replica logged the plugin's routing line (the draft has the Nemotron 3.5 layout);
- round_robin: every greedy answer (streaming or not, prompts within and beyond a cache block)
  equals plain decoding's; the requests alternate between the replicas and EVERY replica drafts
  (its spec-decode counters rise, drafts accepted);
- cache_aware: a multi-turn conversation stays on one replica, every turn equals plain
  decoding's and its prefix-cache hits equal plain decoding's turn for turn;
- kv_aware fed by the replicas' KV events: the same, but the router credits one cache block
  whatever the replica holds (:func:`test_kv_aware_credits_one_block_of_the_hybrid_cache`);
- a replica killed (SIGKILL of its process group) while it decodes: the router retries every
  non-streaming request it had in flight on the survivor, none is lost, all stay exact; a
  stream it had started ends early (a prefix of plain decoding's tokens, no finish reason).

Bounded: every server and router start has a deadline, every request a timeout, every wait a
count; every process is stopped when the module ends (also on failure).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.client import HTTPException
from pathlib import Path

import conversation as conv  # tests/e2e/conversation.py
import pytest

from vllm_nemotron_spec.bench import client as http
from vllm_nemotron_spec.bench import server as serve

pytestmark = pytest.mark.engine

NUM_SPECULATIVE_TOKENS = 3
NUM_SAMPLE_PROMPTS = 4  # then the long prompts (the conftest's `prompts`)
LONG_PROMPT_LENGTHS = (150, 300)  # beyond one 128-token cache block (and two)
MAX_TOKENS = 32
KILL_MAX_TOKENS = 160  # long enough that the victim is still decoding when it is killed
TIMEOUT_S = 180.0
SERVER_START_S = 480.0
ROUTER_START_S = 60.0
REPLICAS = ("replica-0", "replica-1")
KV_BLOCK_TOKENS = conv.BLOCK_TOKENS  # the hybrid target's cache block on CPU in align mode

REPLICA_ARGS = (
    "--dtype",
    "float32",
    "--enforce-eager",
    "--enable-prefix-caching",
    "--mamba-cache-mode",
    "align",
    "--max-model-len",
    "1024",
    "--max-num-seqs",
    "8",
)
ROUTING_LINE = re.compile(r"nemotron-spec: dspark draft \S+ has the Nemotron 3\.5 layout")


def kv_events_config(port: int) -> dict:
    """vLLM's ZMQ KV-event publisher on 127.0.0.1:``port``, bound by the replica. vLLM binds
    only an endpoint with ``*`` or ``::`` in it and CONNECTS to any other (``tcp://127.0.0.1:P``
    would leave both ends connecting: the router's subscriber connects too), so the loopback
    address is written IPv4-mapped; ZeroMQ binds it as 127.0.0.1. The topic stays vLLM's
    default "": vllm-router 0.1.17 drops frames whose topic is not exactly its source's topic,
    and its launcher has no option for that topic (always "")."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://[::ffff:127.0.0.1]:{port}",
    }


# ------------------------------------------------------------------------------------------
# The router process


@dataclass
class Router:
    """A running ``vllm-router``; :meth:`stop` ends it (its own session, so its process group)."""

    proc: subprocess.Popen
    url: str
    log_path: Path

    def log(self) -> str:
        """The router's output without ANSI colours."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return re.sub(r"\x1b\[[0-9;]*m", "", text)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
                return
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


def start_router(urls: list[str], policy: str, log_path: Path, extra: tuple = ()) -> Router:
    """``vllm-router`` (its Python launcher) on a free loopback port in front of ``urls``; returns
    once its ``/health`` answers 200 (it checks the workers' health first)."""
    port, metrics_port = serve.free_port(), serve.free_port()
    cmd = [
        sys.executable,
        "-m",
        "vllm_router.launch_router",
        "--host",
        serve.HOST,
        "--port",
        str(port),
        "--prometheus-host",
        serve.HOST,
        "--prometheus-port",
        str(metrics_port),
        "--worker-urls",
        *urls,
        "--policy",
        policy,
        "--log-level",
        "debug",  # the policies' decisions, the retries
        *extra,
    ]
    with open(log_path, "wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    router = Router(proc, f"http://{serve.HOST}:{port}", log_path)
    deadline = time.monotonic() + ROUTER_START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"vllm-router exited with {proc.returncode}:\n{router.log()[-3000:]}"
            )
        try:
            if http.get(f"{router.url}/health", timeout=2.0)[0] == 200:
                return router
        except OSError:
            pass
        time.sleep(0.3)
    router.stop()
    raise RuntimeError(
        f"vllm-router not ready after {ROUTER_START_S:.0f} s:\n{router.log()[-3000:]}"
    )


@pytest.fixture
def router_factory(servers, tmp_path):
    """Starts routers in front of the two replicas; stops every one at the end of the test."""
    started: list[Router] = []

    def make(policy: str, extra: tuple = ()) -> Router:
        urls = [servers[name].url for name in REPLICAS]
        router = start_router(urls, policy, tmp_path / f"router-{policy}-{len(started)}.log", extra)
        started.append(router)
        return router

    yield make
    for router in started:
        router.stop()


# ------------------------------------------------------------------------------------------
# Servers and the plain reference


@pytest.fixture(scope="module")
def servers(tiny_family, trained, tmp_path_factory):
    """{"plain" | replica name: Server}, all started together, all stopped at the end."""
    logs = tmp_path_factory.mktemp("scale-out-servers")
    spec = {
        "method": "dspark",
        "model": str(trained.dspark),
        "num_speculative_tokens": NUM_SPECULATIVE_TOKENS,
    }
    launched = {}
    try:
        launched["plain"] = serve.launch_server(
            tiny_family.target, logs / "plain.log", args=REPLICA_ARGS
        )
        for name in REPLICAS:
            events_port = serve.free_port()
            args = (*REPLICA_ARGS, "--kv-events-config", json.dumps(kv_events_config(events_port)))
            launched[name] = serve.launch_server(
                tiny_family.target, logs / f"{name}.log", speculative_config=spec, args=args
            )
            launched[name].extra["kv_events"] = f"tcp://{serve.HOST}:{events_port}"
        for server in launched.values():
            serve.wait_ready(server, timeout=SERVER_START_S)
            server.extra["model"] = http.served_model(server.url)
        yield launched
    finally:
        for server in launched.values():
            server.stop()


@dataclass(frozen=True)
class Request:
    prompt: int  # index into the module's prompts
    stream: bool
    max_tokens: int = MAX_TOKENS

    def body(self, model: str, prompts: list) -> dict:
        return {
            "model": model,
            "prompt": prompts[self.prompt]["prompt_token_ids"],
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        }


def run_requests(url: str, model: str, prompts: list, requests: list[Request]) -> list:
    """All ``requests`` in flight at once; a dropped connection (or a stream cut in the middle
    of a chunk) comes back as status 0."""

    def one(r: Request) -> http.Completion:
        try:
            return http.complete(url, r.body(model, prompts), stream=r.stream, timeout=TIMEOUT_S)
        except (OSError, HTTPException, ValueError) as exc:
            return http.Completion(0, [], None, error=f"{type(exc).__name__}: {exc}")

    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        return list(pool.map(one, requests))


@pytest.fixture(scope="module")
def reference(servers, prompts):
    """Plain decoding's tokens for every prompt and length (each request alone)."""
    plain = servers["plain"]
    out = {}
    for max_tokens in (MAX_TOKENS, KILL_MAX_TOKENS):
        for i in range(len(prompts)):
            done = http.complete(
                plain.url,
                Request(i, False, max_tokens).body(plain.extra["model"], prompts),
                stream=False,
                timeout=TIMEOUT_S,
            )
            assert done.status == 200 and len(done.token_ids) == max_tokens, done
            out[(i, max_tokens)] = done.token_ids
    return out


def mismatches(requests: list[Request], got: list, reference: dict) -> list[str]:
    problems = []
    for r, c in zip(requests, got):
        if c.status != 200 or c.error:
            problems.append(f"{r}: HTTP {c.status} {c.error}")
        elif c.token_ids != reference[(r.prompt, r.max_tokens)]:
            problems.append(f"{r}: {c.token_ids} != plain {reference[(r.prompt, r.max_tokens)]}")
    return problems


def replica_counters(servers) -> dict:
    """Per replica: finished requests, spec-decode counters (drafts, drafted tokens, accepted
    tokens), prefix-cache hits and queries."""
    out = {}
    for name in REPLICAS:
        text = http.get_text(f"{servers[name].url}/metrics")
        values = http.sum_samples(http.parse_prometheus_text(text))
        spec = http.spec_counters_from_metrics(text)
        out[name] = {
            "requests": http.metric(values, "vllm:request_success"),
            "spec": (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens),
            "hits": http.metric(values, "vllm:prefix_cache_hits"),
            "queries": http.metric(values, "vllm:prefix_cache_queries"),
        }
    return out


def settled_counters(servers) -> dict:
    """:func:`replica_counters` once two reads agree (a server records its stats right after it
    sent the last tokens)."""
    return http.read_until_settled(lambda: replica_counters(servers), 10.0, 0.3)


def deltas(before: dict, after: dict) -> dict:
    out = {}
    for name in REPLICAS:
        b, a = before[name], after[name]
        out[name] = {
            "requests": a["requests"] - b["requests"],
            "spec": tuple(x - y for x, y in zip(a["spec"], b["spec"])),
            "hits": a["hits"] - b["hits"],
            "queries": a["queries"] - b["queries"],
        }
    return out


# ------------------------------------------------------------------------------------------
# Tests


def test_every_replica_logs_the_plugins_routing_line(servers):
    for name in REPLICAS:
        log = servers[name].log()
        assert ROUTING_LINE.search(log), f"{name}: no plugin routing line in its log"


def test_round_robin_outputs_equal_plain_and_every_replica_drafts(
    servers, prompts, reference, router_factory
):
    router = router_factory("round_robin")
    model = servers["replica-0"].extra["model"]
    load = [Request(i, stream) for i in range(len(prompts)) for stream in (False, True)]
    before = settled_counters(servers)
    got = run_requests(router.url, model, prompts, load)
    moved = deltas(before, settled_counters(servers))
    problems = mismatches(load, got, reference)
    assert not problems, "\n".join(problems[:10])
    print(f"\nround_robin: {moved}")
    for name in REPLICAS:
        drafts, draft_tokens, accepted = moved[name]["spec"]
        assert moved[name]["requests"] == len(load) // 2, moved  # alternating, none retried
        assert drafts > 0 and 0 < accepted <= draft_tokens, (name, moved[name])


def routed_conversation(router_url: str, model: str, servers, stream: list[int]) -> list[dict]:
    """:func:`conversation.run_conversation` through the router: each turn's answer, and the
    replicas' counter deltas over it (nothing else is in flight)."""
    prompt = list(stream[: conv.FIRST_PROMPT_TOKENS])
    user = stream[conv.FIRST_PROMPT_TOKENS :]
    turns = []
    for t in range(conv.TURNS):
        before = settled_counters(servers)
        done = http.complete(
            router_url,
            {
                "model": model,
                "prompt": prompt,
                "max_tokens": conv.MAX_TOKENS,
                "temperature": 0.0,
                "ignore_eos": True,
            },
            stream=False,
            timeout=TIMEOUT_S,
        )
        moved = deltas(before, settled_counters(servers))
        turns.append({"status": done.status, "error": done.error, "tokens": done.token_ids})
        turns[-1]["replicas"] = moved
        prompt = prompt + done.token_ids + user[t * conv.USER_TOKENS : (t + 1) * conv.USER_TOKENS]
    return turns


@pytest.fixture(scope="module")
def plain_conversation(servers, tiny_family):
    stream = conv.conversation_tokens(tiny_family.tokenizer)
    return conv.run_conversation(servers["plain"], stream)["turns"]


def test_cache_aware_conversation_stays_on_one_replica_with_plain_hits(
    servers, tiny_family, plain_conversation, router_factory
):
    router = router_factory("cache_aware")
    stream = conv.conversation_tokens(tiny_family.tokenizer)
    turns = routed_conversation(router.url, servers["replica-0"].extra["model"], servers, stream)
    served = {name for t in turns for name in REPLICAS if t["replicas"][name]["requests"] > 0}
    print(f"\ncache_aware conversation: {[t['replicas'] for t in turns]}")
    assert len(served) == 1, f"the turns went to {served}"
    (replica,) = served
    for t, (p, s) in enumerate(zip(plain_conversation, turns)):
        assert s["status"] == 200, (t, s["error"])
        assert s["tokens"] == p["tokens"], f"turn {t}: differs from plain decoding"
        moved = s["replicas"][replica]
        assert (moved["hits"], moved["queries"]) == (p["hits"], p["queries"]), (t, moved, p)
    assert sum(t["replicas"][replica]["spec"][2] for t in turns) > 0  # drafts accepted


KV_DECISION = re.compile(r"KV prefix decision .*?credited_prefix_tokens=(\d+)")


def other_conversation_tokens(tokenizer_dir) -> list[int]:
    """Like :func:`conversation.conversation_tokens`, from other documents: a conversation that
    no earlier test left in a replica's prefix cache."""
    from vllm_nemotron_spec.tiny.corpus import generate_documents
    from vllm_nemotron_spec.tiny.tokenizer import EOS_ID, load_tokenizer

    stream: list[int] = []
    for enc in load_tokenizer(tokenizer_dir).encode_batch(generate_documents(8642, 200)):
        stream += enc.ids + [EOS_ID]
    need = conv.FIRST_PROMPT_TOKENS + (conv.TURNS - 1) * conv.USER_TOKENS
    assert len(stream) >= need
    return stream[:need]


def test_kv_aware_credits_one_block_of_the_hybrid_cache(servers, tiny_family, router_factory):
    """kv_aware fed by the replicas' KV events (static sources: vLLM has no ``/get_server_info``
    for the router's discovery). The conversation stays on one replica, every turn equals plain
    decoding's and keeps plain decoding's prefix-cache hits, but the router credits ONE cache
    block whatever the replica holds: vllm-router 0.1.17 queries KV-cache group 0 only and, for
    events from a hybrid target, group 0 is a Mamba group, whose events name the last block they
    store with the token ids of the whole prefix (the router pairs that hash with the first
    block's tokens). The requests carry no vLLM-only field such as ``return_token_ids``: the
    router gives any request with a field it does not model no cache credit at all."""
    model = servers["replica-0"].extra["model"]
    extra = ["--kv-event-block-size", str(KV_BLOCK_TOKENS), "--kv-event-model", model]
    for name in REPLICAS:
        extra += ["--kv-event-source", f"{servers[name].url}={servers[name].extra['kv_events']}"]
    router = router_factory("kv_aware", tuple(extra))
    stream = other_conversation_tokens(tiny_family.tokenizer)
    plain_conversation = conv.run_conversation(servers["plain"], stream)["turns"]
    prompt = list(stream[: conv.FIRST_PROMPT_TOKENS])
    user = stream[conv.FIRST_PROMPT_TOKENS :]
    turns = []
    for t in range(conv.TURNS):
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": conv.MAX_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        before = settled_counters(servers)
        status, data = http.post_json(f"{router.url}/v1/completions", body, TIMEOUT_S)
        moved = deltas(before, settled_counters(servers))
        assert status == 200, (t, data)
        plain_status, plain = http.post_json(f"{servers['plain'].url}/v1/completions", body)
        assert plain_status == 200, plain
        turns.append({"text": data["choices"][0]["text"], "replicas": moved})
        assert turns[-1]["text"] == plain["choices"][0]["text"], f"turn {t} differs from plain"
        prompt += plain_conversation[t]["tokens"]  # this turn's tokens (equal text, checked)
        prompt += user[t * conv.USER_TOKENS : (t + 1) * conv.USER_TOKENS]
    served = {n for t in turns for n in REPLICAS if t["replicas"][n]["requests"] > 0}
    assert len(served) == 1, f"the turns went to {served}"
    (replica,) = served
    hits = [t["replicas"][replica]["hits"] for t in turns]
    assert hits == [p["hits"] for p in plain_conversation]
    credited = [int(c) for c in KV_DECISION.findall(router.log())]
    print(f"\nkv_aware: credited {credited}, the replica's prefix-cache hits {hits}")
    assert len(credited) == conv.TURNS, router.log()[-3000:]
    assert credited == [0] + [KV_BLOCK_TOKENS] * (conv.TURNS - 1)
    assert all(h > KV_BLOCK_TOKENS for h in hits[2:])  # the replica held more than one block


def test_killed_replica_loses_no_request_the_router_retries(
    servers, prompts, reference, router_factory
):
    """SIGKILL of one replica's process group while it decodes. Non-streaming requests: the
    router gets no response from the dead replica (HTTP 500 inside the router, a retryable
    status) and sends the request again, through the policy, to the survivor: every one
    returns plain decoding's tokens. A stream that the dead replica had started cannot be
    retried (its 200 and headers are sent): it ends early without a finish reason, its tokens
    a prefix of plain decoding's. ``--cb-failure-threshold 1`` takes the dead replica out of
    the rotation at its first failure (default: after 10 consecutive failures, so a retry can
    land on it again); requests after that go to the survivor only. Keep this test LAST: the
    victim stays dead."""
    router = router_factory("round_robin", ("--cb-failure-threshold", "1"))
    survivor, victim = (servers[name] for name in REPLICAS)
    model = survivor.extra["model"]
    load = [Request(i % len(prompts), i >= 8, KILL_MAX_TOKENS) for i in range(10)]
    with ThreadPoolExecutor(max_workers=len(load)) as pool:
        futures = [pool.submit(run_requests, router.url, model, prompts, [r]) for r in load]
        for _ in range(1200):  # 60 s
            if http.metric(http.read_metrics(victim.url), "vllm:num_requests_running") >= 1:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the victim never ran a request")
        os.killpg(victim.proc.pid, signal.SIGKILL)
        got = [f.result()[0] for f in futures]
    failed = f"Failed to send typed request worker_url={victim.url}"
    retried = router.log().count(failed)
    print(f"\nkilled replica: {retried} request(s) retried on the survivor")
    assert retried >= 1, "no request was in flight on the victim"
    assert "Circuit breaker state transition: closed -> open" in router.log()
    calls = list(zip(load, got))
    whole = [(r, c) for r, c in calls if not r.stream]
    problems = mismatches([r for r, _ in whole], [c for _, c in whole], reference)
    assert not problems, "\n".join(problems)
    for r, c in calls:
        want = reference[(r.prompt, r.max_tokens)]
        if r.stream and c.token_ids != want:  # cut by the kill: a prefix, no finish reason
            assert c.finish_reason is None and c.token_ids == want[: len(c.token_ids)], (r, c)
    before = settled_counters_of(survivor)
    follow = [Request(i, False) for i in range(len(prompts))]
    problems = mismatches(follow, run_requests(router.url, model, prompts, follow), reference)
    assert not problems, "\n".join(problems)
    assert settled_counters_of(survivor) - before == len(follow)
    assert router.log().count(failed) == retried  # the dead replica is out of the rotation


def settled_counters_of(server) -> float:
    """Finished requests of one server, once two reads agree."""
    return http.read_until_settled(
        lambda: http.metric(http.read_metrics(server.url), "vllm:request_success"), 10.0, 0.3
    )
