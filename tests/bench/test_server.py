"""The local ``vllm serve`` launchers: a port taken between choosing it and the server binding it
is retried on a new port (a stand-in server binds the port as vLLM does)."""

from __future__ import annotations

import contextlib
import socket
import sys

import pytest

from vllm_nemotron_spec.bench import server as serve

STAND_IN = """import socket, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
port = int(sys.argv[sys.argv.index("--port") + 1])
sock = socket.socket()
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as vLLM's create_server_socket
try:
    sock.bind(("127.0.0.1", port))
except OSError as e:
    print(f"OSError: {e}", flush=True)
    sys.exit(1)
if "--fail" in sys.argv:
    print("vllm serve: error: invalid SpeculativeConfig: num_speculative_tokens", flush=True)
    sys.exit(2)
class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
server = HTTPServer(("127.0.0.1", port), Health, bind_and_activate=False)
server.socket = sock
server.server_activate()
server.serve_forever()
"""


def listening_socket() -> socket.socket:
    holder = socket.socket()
    holder.bind((serve.HOST, 0))
    holder.listen()
    return holder


def use_stand_in(monkeypatch, tmp_path, next_port) -> None:
    """The stand-in server replaces the ``vllm serve`` command; ``free_port`` is ``next_port``."""
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)

    def command(model, *, port, speculative_config=None, args=()):
        return [sys.executable, str(script), "--port", str(port), *args]

    monkeypatch.setattr(serve, "serve_command", command)
    monkeypatch.setattr(serve, "free_port", next_port)


@pytest.fixture
def taken_port(monkeypatch, tmp_path):
    """A port another process listens on, handed out first by ``free_port``."""
    with listening_socket() as holder:
        port = holder.getsockname()[1]
        first, real_free_port = iter([port]), serve.free_port
        use_stand_in(monkeypatch, tmp_path, lambda: next(first, None) or real_free_port())
        yield port


def test_serve_once_retries_a_taken_port(taken_port):
    result = serve.serve_once("model", args=["--fail"], timeout=60)
    assert result.returncode == 2, result.output
    assert "vllm serve: error: invalid SpeculativeConfig" in result.output
    assert serve.PORT_CLASH not in result.output


def test_started_server_moves_to_a_new_port_when_its_port_is_taken(taken_port, tmp_path):
    server = serve.start_server("model", tmp_path / "serve.log", timeout=60)
    try:
        assert server.url != f"http://{serve.HOST}:{taken_port}"
        assert server.healthy()
        assert f"{serve.PORT_CLASH}: relaunched on port" in server.log()
    finally:
        server.stop()


def test_a_clash_is_retried_once_only(monkeypatch, tmp_path):
    """Every port taken: the second clash is the error, with vLLM's message."""
    with listening_socket() as holder:
        use_stand_in(monkeypatch, tmp_path, lambda: holder.getsockname()[1])
        result = serve.serve_once("model", args=["--fail"], timeout=60)
        assert result.returncode == 1 and serve.PORT_CLASH in result.output
        with pytest.raises(serve.ServerStartError) as err:
            serve.start_server("model", tmp_path / "serve.log", timeout=60)
        assert err.value.returncode == 1 and serve.PORT_CLASH in err.value.log


KILLED_LAUNCHER = """import sys, time
sys.path.insert(0, {repo!r})
from vllm_nemotron_spec.bench import server as serve
serve.serve_command = lambda model, *, port, speculative_config=None, args=(): [
    sys.executable, {script!r}, "--port", str(port)]
srv = serve.start_server("model", {log!r}, timeout=60)
try:
    print(srv.proc.pid, flush=True)
    time.sleep(120)  # a benchmark's workload, cut short by `timeout`
finally:
    print("finally ran", flush=True)
"""


def test_a_launcher_killed_by_sigterm_stops_its_servers(tmp_path):
    """``timeout`` sends SIGTERM to the launcher only (each server has a session of its own):
    the launcher must still stop its servers, or they keep their GPU memory after it died."""
    import os
    import signal
    import subprocess
    from pathlib import Path

    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    repo = str(Path(serve.__file__).resolve().parents[2])
    launcher = tmp_path / "launcher.py"
    launcher.write_text(
        KILLED_LAUNCHER.format(repo=repo, script=str(script), log=str(tmp_path / "serve.log"))
    )
    proc = subprocess.Popen(
        [sys.executable, str(launcher)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    server_pid = int(proc.stdout.readline())
    try:
        os.kill(server_pid, 0)  # the stand-in server runs
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
        assert proc.returncode == 128 + signal.SIGTERM, out
        assert "finally ran" in out
        with pytest.raises(ProcessLookupError):
            os.kill(server_pid, 0)
    finally:  # a failed check leaves no stand-in behind
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server_pid, signal.SIGKILL)
