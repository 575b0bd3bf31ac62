"""A loopback Hugging Face Hub for tests: a real HTTP server on 127.0.0.1 serving local
directories under repo ids, with the endpoints ``huggingface_hub`` uses.

- ``GET /api/models/{repo}[/revision/{rev}]``: model info (``sha``, ``siblings``);
- ``GET /api/models/{repo}/tree/{rev}[/{path}]``: the file listing (``snapshot_download``);
- ``HEAD`` / ``GET /{repo}/resolve/{rev}/{file}`` with ``Range``: the file, with ``X-Repo-Commit``,
  ``ETag`` and ``Content-Length`` (``hf_hub_download``, ``file_exists``,
  ``get_safetensors_metadata``, which reads header byte ranges).

``refuse_ranges`` makes ranged reads fail (a Hub whose metadata cannot be read remotely).
Unknown repos, revisions and files answer 404 with the ``X-Error-Code`` the Hub sends, so
``huggingface_hub`` raises its usual errors. Every body byte sent is counted per (repo, file).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


class Revision:
    """One revision of a repo: its files (name -> bytes) and a commit id derived from them."""

    def __init__(self, files: dict[str, bytes]):
        self.files = files
        digest = hashlib.sha1()
        for name in sorted(files):
            digest.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
        self.commit = digest.hexdigest()


class LoopbackHub:
    """``repos``: repo id -> {revision name: directory or {file: bytes}}. Use as a context
    manager; ``endpoint`` is the URL for ``HF_ENDPOINT``; ``served[(repo, file)]`` counts the
    body bytes sent."""

    def __init__(self, repos: dict[str, dict[str, Path | dict[str, bytes]]]):
        self.repos: dict[str, dict[str, Revision]] = {}
        for repo, revisions in repos.items():
            self.repos[repo] = {}
            for name, source in revisions.items():
                files = (
                    source
                    if isinstance(source, dict)
                    else {p.name: p.read_bytes() for p in Path(source).iterdir() if p.is_file()}
                )
                self.repos[repo][name] = Revision(files)
        self.served: Counter = Counter()
        self.refuse_ranges = False  # True: ranged GETs answer 500 (no remote header reads)
        self.requests: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def served_bytes(self, repo: str, suffix: str = "") -> int:
        """Body bytes sent for the repo's files whose names end with ``suffix``."""
        return sum(n for (r, f), n in self.served.items() if r == repo and f.endswith(suffix))

    def __enter__(self) -> "LoopbackHub":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def revision(self, repo: str, rev: str) -> Revision | None:
        revisions = self.repos.get(repo, {})
        if rev in revisions:
            return revisions[rev]
        return next((r for r in revisions.values() if r.commit == rev), None)

    def _count(self, repo: str, name: str, n: int) -> None:
        with self._lock:
            self.served[(repo, name)] += n

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _send(self, status, body=b"", headers=None, head=False):
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                if "Content-Length" not in (headers or {}):
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head and body:
                    self.wfile.write(body)

            def _error(self, code, message, commit=None, head=False):
                headers = {
                    "X-Error-Code": code,
                    "X-Error-Message": message,
                    "Content-Type": "application/json",
                }
                if commit:
                    headers["X-Repo-Commit"] = commit
                status = 404
                self._send(status, json.dumps({"error": message}).encode(), headers, head)

            def _json(self, value):
                self._send(200, json.dumps(value).encode(), {"Content-Type": "application/json"})

            def do_HEAD(self):
                self._route(head=True)

            def do_GET(self):
                self._route(head=False)

            def _route(self, head):
                path = urlsplit(self.path).path
                with hub._lock:
                    hub.requests.append((self.command, path))
                m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
                if m:
                    return self._info(unquote(m[1]), unquote(m[2] or "main"))
                m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(/.*)?", path)
                if m:
                    return self._tree(unquote(m[1]), unquote(m[2]), unquote(m[3] or "/"))
                m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
                if m:
                    return self._file(unquote(m[1]), unquote(m[2]), unquote(m[3]), head)
                self._error("NotFound", f"no route {path}", head=head)

            def _lookup(self, repo, rev, head=False):
                if repo not in hub.repos:
                    self._error("RepoNotFound", f"Repository {repo} not found", head=head)
                    return None
                found = hub.revision(repo, rev)
                if found is None:
                    self._error("RevisionNotFound", f"Invalid rev id: {rev}", head=head)
                return found

            def _info(self, repo, rev):
                r = self._lookup(repo, rev)
                if r is not None:
                    self._json(
                        {
                            "id": repo,
                            "modelId": repo,
                            "sha": r.commit,
                            "private": False,
                            "siblings": [{"rfilename": n} for n in sorted(r.files)],
                        }
                    )

            def _tree(self, repo, rev, sub):
                r = self._lookup(repo, rev)
                if r is not None:
                    self._json(
                        [
                            {
                                "type": "file",
                                "path": n,
                                "size": len(b),
                                "oid": hashlib.sha1(b).hexdigest(),
                            }
                            for n, b in sorted(r.files.items())
                            if sub in ("/", "")
                        ]
                    )

            def _file(self, repo, rev, name, head):
                r = self._lookup(repo, rev, head)
                if r is None:
                    return
                if name not in r.files:
                    return self._error("EntryNotFound", f"{name} not found", r.commit, head)
                data = r.files[name]
                headers = {
                    "X-Repo-Commit": r.commit,
                    "Accept-Ranges": "bytes",
                    "ETag": '"' + hashlib.sha256(data).hexdigest() + '"',
                    "Content-Type": "application/octet-stream",
                }
                status, body = 200, data
                rng = self.headers.get("Range")
                if rng and hub.refuse_ranges and not head:
                    return self._send(500, b"ranges refused", {"X-Repo-Commit": r.commit})
                m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng or "")
                if m and not head:
                    start = int(m[1])
                    end = min(int(m[2]) if m[2] else len(data) - 1, len(data) - 1)
                    body = data[start : end + 1]
                    status = 206
                    headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
                headers["Content-Length"] = str(len(body) if not head else len(data))
                if not head:
                    hub._count(repo, name, len(body))
                self._send(status, body, headers, head)

        return Handler
