"""A small JSON-over-HTTP server on loopback for backends that cannot run here.

`JsonServer(handler)` calls `handler(method, path, body, headers)` for every request,
records it, and sends back the `(status, payload)` it returns, exactly as given.
`JsonFake` is the base of the fake backends beside this module (one module per backend):
each answers in its real server's JSON (documented shapes, including its errors), is
configured per test through its fields, and answers a path it does not serve with a 404
that stays recorded in `calls`.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

Handler = Callable[[str, str, Any, Mapping[str, str]], tuple[int, Any]]


@dataclass
class Call:
    method: str
    path: str
    body: Any
    headers: dict[str, str]


@dataclass
class JsonServer:
    handler: Handler
    calls: list[Call] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def posts(self, path: str) -> list[Call]:
        with self._lock:
            return [c for c in self.calls if c.method == "POST" and c.path == path]

    def start(self) -> JsonServer:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True

            def log_message(self, *args: Any) -> None:
                pass

            def _handle(self, method: str) -> None:
                length = int(self.headers.get("Content-Length", 0))
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else None
                headers = {k.lower(): v for k, v in self.headers.items()}
                with fake._lock:
                    fake.calls.append(Call(method, self.path, body, headers))
                status, payload = fake.handler(method, self.path, body, headers)
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._handle("GET")

            def do_POST(self) -> None:
                self._handle("POST")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


class JsonFake:
    """A fake backend served by a `JsonServer`; a subclass answers in `handle`."""

    _server: JsonServer | None = None

    def handle(
        self, method: str, path: str, body: Any, headers: Mapping[str, str]
    ) -> tuple[int, Any]:
        """The `(status, payload)` for one request (`JsonServer`'s handler)."""
        raise NotImplementedError

    def start(self) -> Self:
        """Listen on a free port of 127.0.0.1."""
        self._server = JsonServer(self.handle).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()

    @property
    def url(self) -> str:
        return self._running.url

    @property
    def calls(self) -> list[Call]:
        """Every request received, a refused or unknown one included, in arrival order."""
        return self._running.calls

    def posts(self, path: str) -> list[Call]:
        return self._running.posts(path)

    @property
    def _running(self) -> JsonServer:
        assert self._server is not None, "the fake was not started"
        return self._server
