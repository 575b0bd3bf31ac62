"""The HTTP client of a local ``vllm serve``: standard library only, loopback servers only.

OpenAI completions (:func:`complete`, streaming or not, token ids and per-chunk timing back),
any JSON POST (:func:`post_json`), server-sent events (:func:`sse_chunks`) and Prometheus
``/metrics`` (:func:`parse_prometheus_text`, :func:`spec_counters_from_metrics`,
:func:`read_metrics`).
"""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from vllm_nemotron_spec.bench.stats import BenchError
from vllm_nemotron_spec.runs import SpecCounters

T = TypeVar("T")


def http_request(url: str, body: dict | None = None, timeout: float = 60.0):
    """``urlopen`` of a GET (``body`` None) or a JSON POST; raises ``urllib.error.HTTPError``
    for error statuses (loopback servers only)."""
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json"} if data else {}
    )
    return urllib.request.urlopen(req, timeout=timeout)  # noqa: S310 (loopback only)


def get(url: str, timeout: float = 30.0) -> tuple[int, str]:
    """``(status, body)`` of a GET (HTTP errors are returned, not raised)."""
    import urllib.error

    try:
        with http_request(url, None, timeout) as resp:
            return resp.status, resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode("utf-8", "replace")


def post_json(url: str, body: dict, timeout: float = 120.0) -> tuple[int, dict | str]:
    """``(status, parsed JSON or raw text)`` of a POST (HTTP errors are returned, not raised)."""
    import urllib.error

    try:
        with http_request(url, body, timeout) as resp:
            status, text = resp.status, resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read().decode("utf-8", "replace")
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


@dataclass
class Completion:
    """One completion: token ids, finish reason, text, and (streamed) when the first and last
    chunk arrived (``time.perf_counter`` values), ``usage`` and vLLM's per-request ``metrics``."""

    status: int
    token_ids: list[int]
    finish_reason: str | None
    text: str = ""
    error: str | None = None
    seconds: float = 0.0
    chunks: int = 0
    start: float = 0.0
    first_token: float | None = None
    end: float = 0.0
    usage: dict | None = None
    metrics: dict | None = None


class CompletionError(RuntimeError):
    pass


def complete(url: str, body: dict, *, stream: bool, timeout: float = 300.0) -> Completion:
    """One ``/v1/completions`` request (``n`` = 1) with ``return_token_ids``; the generated token
    ids, finish reason and text, streamed or not. A non-200 answer (or an error event in the
    stream) comes back with ``error``; a server that cannot be reached raises ``OSError``."""
    import urllib.error

    body = dict(body, stream=stream, return_token_ids=True)
    start = time.perf_counter()
    if not stream:
        status, data = post_json(f"{url}/v1/completions", body, timeout)
        end = time.perf_counter()
        if status != 200 or not isinstance(data, dict):
            return Completion(
                status, [], None, error=_error_text(data), seconds=end - start, start=start, end=end
            )
        choice = data["choices"][0]
        return Completion(
            status,
            list(choice.get("token_ids") or []),
            choice.get("finish_reason"),
            choice.get("text") or "",
            seconds=end - start,
            start=start,
            end=end,
            usage=data.get("usage"),
        )
    out = Completion(200, [], None, start=start)
    text: list[str] = []
    try:
        with http_request(f"{url}/v1/completions", body, timeout) as resp:
            for chunk in sse_chunks(resp):
                now = time.perf_counter()
                if "error" in chunk:
                    out.error = _error_text(chunk)
                    break
                out.chunks += 1
                for choice in chunk.get("choices") or []:
                    ids = choice.get("token_ids") or []
                    if ids or choice.get("text"):
                        out.first_token = now if out.first_token is None else out.first_token
                    out.token_ids.extend(ids)
                    text.append(choice.get("text") or "")
                    out.finish_reason = choice.get("finish_reason") or out.finish_reason
                if chunk.get("usage"):
                    out.usage = chunk["usage"]
                if chunk.get("metrics"):
                    out.metrics = chunk["metrics"]
    except urllib.error.HTTPError as exc:
        out = Completion(
            exc.code,
            [],
            None,
            start=start,
            error=_error_text(exc.read().decode("utf-8", "replace")),
        )
    out.text = "".join(text)
    out.end = time.perf_counter()
    out.seconds = out.end - start
    return out


def get_text(url: str, timeout: float = 30.0) -> str:
    """The body of a GET that must answer 200; :class:`BenchError` naming the URL otherwise."""
    import urllib.error

    try:
        with http_request(url, None, timeout) as resp:
            return resp.read().decode("utf-8")
    except urllib.error.HTTPError as exc:
        raise BenchError(f"GET {url}: HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise BenchError(
            f"GET {url}: {getattr(exc, 'reason', exc)} (is the server running?)"
        ) from None


def served_model(url: str, timeout: float = 30.0) -> str:
    """The first model a server at ``url`` lists under ``/v1/models`` (the name requests use);
    :class:`BenchError` naming the URL when it answers otherwise or lists none."""
    data = json.loads(get_text(f"{url}/v1/models", timeout))
    models = [m.get("id") for m in data.get("data", []) if m.get("id")]
    if not models:
        raise BenchError(f"GET {url}/v1/models: the server lists no model")
    return models[0]


def sse_chunks(resp) -> Iterator[dict]:
    """The JSON chunks of an OpenAI-style server-sent-event stream, up to ``data: [DONE]``."""
    for raw in resp:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data:"):
            continue
        payload = line[len("data:") :].strip()
        if payload == "[DONE]":
            return
        yield json.loads(payload)


def read_until_settled(read: Callable[[], T], settle_s: float, interval_s: float) -> T:
    """``read()`` again every ``interval_s`` until two reads agree or ``settle_s`` passed (a
    server records its stats right after it sent the last tokens); the last read."""
    deadline = time.monotonic() + settle_s
    current = read()
    while time.monotonic() < deadline:
        time.sleep(interval_s)
        again = read()
        if again == current:
            break
        current = again
    return current


def _error_text(data) -> str:
    if isinstance(data, str):
        try:
            data = json.loads(data)
        except json.JSONDecodeError:
            return data[:500]
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            return str(err.get("message", err))[:500]
        return str(err)[:500]
    return str(data)[:500]


def stream_and_disconnect(
    url: str, body: dict, *, after_chunks: int, timeout: float = 120.0
) -> int:
    """Start a streaming completion, read ``after_chunks`` data chunks, then close the connection
    (a client that goes away mid-stream). Returns the number of chunks read."""
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    read = 0
    try:
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps(dict(body, stream=True)),
            {"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        if resp.status != 200:
            raise CompletionError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
        while read < after_chunks:
            line = resp.readline()
            if not line:
                break
            if line.startswith(b"data:") and b"[DONE]" not in line:
                read += 1
    finally:
        # Close the socket itself, not just the response: the server must see the disconnect.
        try:
            conn.sock and conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        conn.close()
    return read


def read_metric_samples(url: str, timeout: float = 30.0) -> list[tuple[str, dict, float]]:
    """``/metrics`` of the server at ``url`` as Prometheus samples ``(name, labels, value)``."""
    return parse_prometheus_text(get_text(f"{url}/metrics", timeout))


def sum_samples(samples, by_label: str | None = None) -> dict:
    """Samples summed per name (``_created`` dropped), or, with ``by_label``, per
    ``(name, value of that label)``."""
    out: dict = {}
    for name, labels, value in samples:
        if name.endswith("_created"):
            continue
        key = name if by_label is None else (name, labels.get(by_label))
        out[key] = out.get(key, 0.0) + value
    return out


def read_metrics(url: str, timeout: float = 30.0) -> dict[str, float]:
    """``/metrics`` as ``{name: value}`` summed over label sets (``_created`` samples dropped;
    ``*_total`` names kept as written)."""
    return sum_samples(read_metric_samples(url, timeout))


def metric(metrics: dict[str, float], name: str) -> float:
    """A counter by its base name (with or without ``_total``); 0 when absent."""
    return metrics.get(name, metrics.get(f"{name}_total", 0.0))


_SAMPLE = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\S+)?$"
)
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


def parse_prometheus_text(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Samples of a Prometheus text exposition: ``(name, labels, value)``; comments skipped."""
    samples = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            raise BenchError(f"/metrics line {lineno}: not a Prometheus sample: {line[:80]!r}")
        labels = {}
        body = m.group("labels") or ""
        pos = 0
        while pos < len(body):
            lm = _LABEL.match(body, pos)
            if lm is None:
                raise BenchError(f"/metrics line {lineno}: bad labels: {body[:80]!r}")
            labels[lm.group(1)] = bytes(lm.group(2), "utf-8").decode("unicode_escape")
            pos = lm.end()
        try:
            value = float(m.group("value"))
        except ValueError:
            raise BenchError(f"/metrics line {lineno}: bad value {m.group('value')!r}") from None
        samples.append((m.group("name"), labels, value))
    return samples


def spec_counters_from_metrics(text: str) -> SpecCounters | None:
    """vLLM's spec-decode counters in a /metrics text (summed over engines and models); None
    when the server does no speculative decoding."""
    names = {
        "vllm:spec_decode_num_drafts": "num_drafts",
        "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
    }
    per_pos_name = "vllm:spec_decode_num_accepted_tokens_per_pos"
    out, per_pos, found = SpecCounters(), {}, False
    for name, labels, value in parse_prometheus_text(text):
        if name.endswith("_created"):
            continue
        base = name[: -len("_total")] if name.endswith("_total") else name
        if base in names:
            setattr(out, names[base], getattr(out, names[base]) + int(value))
            found = True
        elif base == per_pos_name:
            if "position" not in labels:
                raise BenchError(f"/metrics: {name} without a position label")
            pos = int(labels["position"])
            per_pos[pos] = per_pos.get(pos, 0) + int(value)
            found = True
    if not found:
        return None
    if per_pos:
        out.accepted_per_position = [per_pos.get(p, 0) for p in range(max(per_pos) + 1)]
    return out
