"""``client.served_model``: the model name a server lists, read from a real HTTP server on
127.0.0.1; a server that lists none, or answers with an error, is named in the error."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from vllm_nemotron_spec.bench import client
from vllm_nemotron_spec.bench.stats import BenchError


@pytest.fixture
def models_server():
    answer = {}

    class Models(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            status, body = answer["status"], json.dumps(answer["body"]).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Models)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", answer
    finally:
        server.shutdown()
        server.server_close()


def test_the_first_listed_model_is_the_served_name(models_server):
    url, answer = models_server
    answer.update(status=200, body={"data": [{"id": "tiny-target"}, {"id": "lora-a"}]})
    assert client.served_model(url) == "tiny-target"


@pytest.mark.parametrize(
    "status, body, says",
    [
        (200, {"data": []}, "lists no model"),
        (200, {"data": [{"object": "model"}]}, "lists no model"),
        (503, {"error": "starting"}, "HTTP 503"),
    ],
)
def test_a_server_without_a_model_is_named(models_server, status, body, says):
    url, answer = models_server
    answer.update(status=status, body=body)
    with pytest.raises(BenchError, match=says) as err:
        client.served_model(url)
    assert f"{url}/v1/models" in str(err.value)
