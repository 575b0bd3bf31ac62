"""Server runs: a bounded pool of streaming clients against the OpenAI completions endpoint of
running ``vllm serve`` processes on this machine, with ``/metrics`` read before and after for the
spec-decode counters. Timing is measured by the client."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from vllm_nemotron_spec.bench.client import (
    Completion,
    complete,
    get_text,
    read_until_settled,
    served_model,
    spec_counters_from_metrics,
)
from vllm_nemotron_spec.bench.offline import WARMUP_PROMPTS, WARMUP_TOKENS, say
from vllm_nemotron_spec.bench.stats import (
    BenchError,
    RunStats,
    add_histograms,
    histogram_from_counters,
)
from vllm_nemotron_spec.runs import SpecCounters

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class ServerSpec:
    label: str
    url: str  # base URL without trailing slash, e.g. http://127.0.0.1:8000


def parse_server_spec(text: str) -> ServerSpec:
    """``[LABEL=]http://127.0.0.1:PORT``; only servers on this machine (loopback)."""
    from urllib.parse import urlsplit

    label, url = "", text.strip()
    head, sep, tail = url.partition("=")
    if sep and "/" not in head and ":" not in head:
        label, url = head.strip(), tail.strip()
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BenchError(
            f"--server {text!r}: expected [LABEL=]http://127.0.0.1:PORT (the address of a "
            "running `vllm serve`)"
        )
    if parts.hostname not in LOOPBACK_HOSTS:
        raise BenchError(
            f"--server {text!r}: host {parts.hostname!r} is not this machine; bench talks only to "
            f"servers on {', '.join(LOOPBACK_HOSTS)} (run it on the server's machine)"
        )
    base = f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"
    if base.endswith("/v1"):
        base = base[: -len("/v1")]
    return ServerSpec(label or parts.netloc, base)


def server_model(server: ServerSpec, timeout: float = 30.0) -> str:
    return served_model(server.url, timeout)


def server_counters(server: ServerSpec, timeout: float = 30.0) -> SpecCounters | None:
    return spec_counters_from_metrics(get_text(f"{server.url}/metrics", timeout))


def stream_completion(
    server: ServerSpec,
    model: str,
    prompt: str,
    *,
    max_tokens: int,
    temperature: float,
    ignore_eos: bool,
    timeout: float,
) -> Completion:
    """One streaming ``/v1/completions`` request, timed per chunk; :class:`BenchError` when it
    fails."""
    url = f"{server.url}/v1/completions"
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream_options": {"include_usage": True},
        "ignore_eos": ignore_eos,
        "seed": 0,
    }
    try:
        result = complete(server.url, body, stream=True, timeout=timeout)
    except OSError as exc:
        raise BenchError(f"POST {url}: {getattr(exc, 'reason', exc)}") from None
    if result.error is not None:
        raise BenchError(f"POST {url}: HTTP {result.status}: {result.error[:300]}")
    return result


def _completion_tokens(c: Completion) -> int:
    tokens = (c.usage or {}).get("completion_tokens")
    return int(tokens) if tokens is not None else len(c.token_ids)


def _spec_metrics(c: Completion) -> dict | None:
    return (c.metrics or {}).get("speculative_decoding") or None


def run_server(
    servers: list[ServerSpec],
    prompts: list[str],
    *,
    max_tokens: int,
    temperature: float = 0.0,
    ignore_eos: bool = False,
    max_concurrency: int = 8,
    timeout: float = 600.0,
    warmup: bool = True,
    progress: bool = True,
    metrics_settle_s: float = 5.0,
) -> tuple[list[RunStats], dict[str, str]]:
    """Benchmark each running server on the prompt set; returns the runs and the model each
    server serves."""
    results, models = [], {}
    for i, server in enumerate(servers, start=1):
        run = RunStats(server.label, "server", num_prompts=len(prompts))
        say(progress, f"bench [{i}/{len(servers)}] {server.label}: {server.url}")
        model = server_model(server)
        models[server.label] = model
        kwargs = dict(
            max_tokens=max_tokens, temperature=temperature, ignore_eos=ignore_eos, timeout=timeout
        )
        if warmup:
            _run_pool(
                server,
                model,
                prompts[:WARMUP_PROMPTS],
                dict(kwargs, max_tokens=min(WARMUP_TOKENS, max_tokens), temperature=0.0),
                max_concurrency,
                progress=False,
            )
        before = server_counters(server)
        records = _run_pool(server, model, prompts, kwargs, max_concurrency, progress)
        after = _settled_counters(server, metrics_settle_s)
        run.method = "plain" if after is None else "speculative"
        run.token_ids = [r.token_ids for r in records]
        run.output_tokens = sum(_completion_tokens(r) for r in records)
        run.seconds = max(r.end for r in records) - min(r.start for r in records)
        run.ttft_ms = [1000.0 * (r.first_token - r.start) for r in records if r.first_token]
        run.tpot_ms = [
            1000.0 * (r.end - r.first_token) / (_completion_tokens(r) - 1)
            for r in records
            if r.first_token and _completion_tokens(r) > 1
        ]
        run.timing_source = "client_stream"
        if after is not None:
            run.counters = after.minus(before) if before is not None else after
            run.num_speculative_tokens = len(run.counters.accepted_per_position) or None
            specs = [_spec_metrics(r) for r in records if _spec_metrics(r)]
            if len(specs) == len(records):
                hist = None
                for s in specs:
                    hist = add_histograms(hist, s.get("acceptance_histogram") or [])
                run.histogram, run.histogram_source = hist, "per_request_metrics"
            else:
                run.histogram = histogram_from_counters(run.counters)
                run.histogram_source = "per_position_counters" if run.histogram else None
        results.append(run)
    return results, models


def _run_pool(server, model, prompts, kwargs, max_concurrency, progress) -> list[Completion]:
    from concurrent.futures import ThreadPoolExecutor

    from tqdm.auto import tqdm

    bar = tqdm(total=len(prompts), desc="requests", file=sys.stderr, disable=not progress)
    records: list[Completion | None] = [None] * len(prompts)

    def one(i: int) -> None:
        records[i] = stream_completion(server, model, prompts[i], **kwargs)
        bar.update(1)

    try:
        with ThreadPoolExecutor(max_workers=max(1, max_concurrency)) as pool:
            for future in [pool.submit(one, i) for i in range(len(prompts))]:
                future.result()
    finally:
        bar.close()
    return records  # type: ignore[return-value]


def _settled_counters(server, settle_s: float) -> SpecCounters | None:
    """/metrics after the run, read until two reads 0.2 s apart agree."""
    return read_until_settled(lambda: server_counters(server), settle_s, 0.2)
