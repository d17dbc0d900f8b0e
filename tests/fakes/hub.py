"""A fake Hugging Face hub: a real HTTP server on 127.0.0.1 answering what huggingface_hub
asks when it downloads one file or lists a model repository.

`repos` maps `"org/name"` to `{path in the repository: bytes}`. For each repository the
fake serves:

- `HEAD` and `GET /{repo}/resolve/{revision}/{path}`: the file as the hub serves an LFS
  file, without the CDN redirect (the client reads the same headers either way): `ETag`
  and `X-Linked-Etag` (the sha256 of the bytes, which the client names the cached blob
  after), `X-Linked-Size`, `X-Repo-Commit`, `Content-Length`, `Accept-Ranges`; a `GET`
  with `Range: bytes=N-` gets a 206 with the rest (or, with `ranges` off, a 200 with the
  whole file, as a server without range support answers).
- `GET /api/models/{repo}[/revision/{revision}]`: model info with `id`, `sha` and
  `siblings`.

The revisions are `main` and the repository's commit hash (a digest of its files). Errors
come as the hub sends them, with the `X-Error-Code` header huggingface_hub turns into its
exception classes: a missing repository is `RepoNotFound` (401 without a token, as the
hub answers so as not to reveal private ones), a missing file `EntryNotFound`, a missing
revision `RevisionNotFound`. No Xet headers are sent, so the client downloads over plain
HTTP. Faults are fields set per test; every request is recorded in `calls`.
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

from tests.fakes.json_server import Call


@dataclass
class FakeHub:
    """Configure before or during a test; all fields are read per request."""

    repos: dict[str, dict[str, bytes]] = field(default_factory=dict)
    # When set, every repository needs `Authorization: Bearer <token>`; without it the
    # fake refuses as the hub does a gated repository (`gated`) or a private one.
    token: str | None = None
    gated: bool = False
    # The next file GETs close their connections after these many body bytes, one a GET,
    # as dropped connections would.
    cuts: list[int] = field(default_factory=list)
    # False: `Range` is ignored and every file GET gets the whole file with 200.
    ranges: bool = True
    # File GETs send other bytes than the ones the headers describe (same length).
    corrupt: bool = False
    calls: list[Call] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None, "the fake was not started"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def requests(self, method: str, repo: str, filename: str) -> list[Call]:
        """The `method` requests for one file, any revision."""
        with self._lock:
            return [
                c
                for c in self.calls
                if c.method == method
                and c.path.startswith(f"/{repo}/resolve/")
                and c.path.split("/", 5)[-1] == filename
            ]

    @staticmethod
    def commit(files: dict[str, bytes]) -> str:
        """The commit hash the fake gives a repository holding `files`."""
        digest = hashlib.sha1()
        for name in sorted(files):
            digest.update(f"{name}\0{hashlib.sha256(files[name]).hexdigest()}\0".encode())
        return digest.hexdigest()

    def start(self) -> FakeHub:
        """Listen on a free port of 127.0.0.1."""
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True

            def log_message(self, *args: Any) -> None:
                pass

            def do_HEAD(self) -> None:
                fake._answer(self, "HEAD")

            def do_GET(self) -> None:
                fake._answer(self, "GET")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        # `stop` waits for the loop's next poll.
        poll = {"poll_interval": 0.02}
        threading.Thread(target=self._server.serve_forever, kwargs=poll, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def _answer(self, http: BaseHTTPRequestHandler, method: str) -> None:
        path = urlsplit(http.path).path
        headers = {k.lower(): v for k, v in http.headers.items()}
        with self._lock:
            self.calls.append(Call(method, path, None, headers))
        parts = [unquote(p) for p in path.split("/")]
        if len(parts) >= 5 and parts[1] == "api" and parts[2] == "models" and method == "GET":
            # /api/models/{org}/{name}[/revision/{revision}]
            revision = parts[6] if len(parts) >= 7 and parts[5] == "revision" else "main"
            self._model_info(http, f"{parts[3]}/{parts[4]}", revision, headers)
        elif len(parts) >= 6 and parts[3] == "resolve":
            # /{org}/{name}/resolve/{revision}/{path...}
            self._resolve(http, method, f"{parts[1]}/{parts[2]}", parts[4], "/".join(parts[5:]))
        else:
            _send(http, method, 404, {"X-Error-Message": "Not Found"}, _error("Not Found"))

    def _refusal(self, repo: str, headers: dict[str, str]) -> tuple[int, dict[str, str]] | None:
        """The hub's answer when the request may not see `repo`, else None."""
        authorized = self.token is None or headers.get("authorization") == f"Bearer {self.token}"
        if repo in self.repos and authorized:
            return None
        if repo in self.repos and self.gated:
            message = f"Access to model {repo} is restricted. You must have access to it."
            return 401, {"X-Error-Code": "GatedRepo", "X-Error-Message": message}
        # A missing repository and a private one look alike to whoever may not see it.
        status = 404 if "authorization" in headers else 401
        return status, {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"}

    def _commit_of(self, repo: str, revision: str) -> str | None:
        commit = self.commit(self.repos[repo])
        return commit if revision in ("main", commit) else None

    def _model_info(
        self, http: BaseHTTPRequestHandler, repo: str, revision: str, headers: dict[str, str]
    ) -> None:
        refused = self._refusal(repo, headers)
        if refused is not None:
            status, error = refused
            _send(http, "GET", status, error, _error(error["X-Error-Message"]))
            return
        commit = self._commit_of(repo, revision)
        if commit is None:
            error = {"X-Error-Code": "RevisionNotFound", "X-Error-Message": "Invalid rev id"}
            _send(http, "GET", 404, error, _error("Invalid rev id"))
            return
        siblings = [{"rfilename": name} for name in sorted(self.repos[repo])]
        info = {"_id": commit[:24], "id": repo, "sha": commit, "siblings": siblings}
        _send(http, "GET", 200, {"Content-Type": "application/json"}, json.dumps(info).encode())

    def _resolve(
        self, http: BaseHTTPRequestHandler, method: str, repo: str, revision: str, filename: str
    ) -> None:
        headers = {k.lower(): v for k, v in http.headers.items()}
        refused = self._refusal(repo, headers)
        if refused is not None:
            status, error = refused
            _send(http, method, status, error, _error(error["X-Error-Message"]))
            return
        commit = self._commit_of(repo, revision)
        if commit is None:
            error = {"X-Error-Code": "RevisionNotFound", "X-Error-Message": "Invalid rev id"}
            _send(http, method, 404, error, _error("Invalid rev id"))
            return
        data = self.repos[repo].get(filename)
        if data is None:
            error = {
                "X-Error-Code": "EntryNotFound",
                "X-Error-Message": "Entry not found",
                "X-Repo-Commit": commit,
            }
            _send(http, method, 404, error, _error("Entry not found"))
            return
        sha256 = hashlib.sha256(data).hexdigest()
        meta = {
            "Content-Type": "application/octet-stream",
            "Accept-Ranges": "bytes" if self.ranges else "none",
            "ETag": f'"{sha256}"',
            "X-Linked-Etag": f'"{sha256}"',
            "X-Linked-Size": str(len(data)),
            "X-Repo-Commit": commit,
        }
        if method == "HEAD":
            _send(http, method, 200, meta, data)
            return
        with self._lock:
            cut = self.cuts.pop(0) if self.cuts else None
        body = bytes(b ^ 0xFF for b in data) if self.corrupt else data
        start = _range_start(headers.get("range")) if self.ranges else 0
        status = 200
        if start:
            status = 206
            meta["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            body = body[start:]
        _send(http, method, status, meta, body, cut=cut)


def _error(message: str) -> bytes:
    return json.dumps({"error": message}).encode()


def _range_start(header: str | None) -> int:
    """The first byte of `Range: bytes=N-` (what the client sends to resume), else 0."""
    if header is None or not header.startswith("bytes=") or not header.endswith("-"):
        return 0
    return int(header.removeprefix("bytes=").removesuffix("-"))


def _send(
    http: BaseHTTPRequestHandler,
    method: str,
    status: int,
    headers: dict[str, str],
    body: bytes,
    cut: int | None = None,
) -> None:
    """Answer with `body` (its length only, for HEAD); with `cut`, close the connection
    after that many body bytes, as a dropped connection would."""
    try:
        http.send_response(status)
        for name, value in headers.items():
            http.send_header(name, value)
        http.send_header("Content-Length", str(len(body)))
        http.end_headers()
        if method == "HEAD":
            return
        if cut is None:
            http.wfile.write(body)
            return
        http.wfile.write(body[:cut])
        http.wfile.flush()
        http.close_connection = True
        http.connection.shutdown(socket.SHUT_RDWR)
    except (BrokenPipeError, ConnectionResetError):
        http.close_connection = True
