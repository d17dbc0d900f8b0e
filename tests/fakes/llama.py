"""A fake llama-server: a real HTTP server on 127.0.0.1 answering in llama-server's JSON.

It serves `/health` and `/v1/chat/completions` with the exact response shape of
llama-server (choices[0].logprobs.content[0].top_logprobs[] of {id, token, bytes,
logprob}). Scores, latency and failures are configurable per test, and it records what it
received, how many calls were in flight at once, and how many finished.

Calls at once are counted two ways. `max_in_flight`: calls open on the wire, a hung call
no longer once its caller hung up. `max_in_hand`: calls the backend is working on, as a
model server counts them: from the body read until the answer is ready, whether or not
the caller is still connected (llama-server finishes a non-streamed task whose client hung
up), and a hung call until it is released. `--concurrency` bounds the second.
"""

from __future__ import annotations

import json
import math
import re
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_DOCUMENT = re.compile(r"<Document>: (.*)\Z", re.DOTALL)

# Modes: how the fake answers chat requests.
OK = "ok"
HTTP_500 = "http_500"
NOT_JSON = "not_json"
NO_LOGPROBS = "no_logprobs"
NO_YES_NO = "no_yes_no"
ONLY_YES = "only_yes"
DROP_CONNECTION = "drop_connection"
HANG = "hang"  # accept the call, never answer (until `unhang`)
EXCEEDS_CONTEXT = "exceeds_context"  # llama-server's 400 for a prompt longer than a slot


@dataclass
class FakeLlamaServer:
    """Configure before or during a test; all fields are read per request."""

    # p(yes) for a document: the first (marker, p) whose marker occurs in the document.
    scores: dict[str, float] = field(default_factory=dict)
    default_score: float = 0.5
    latency_s: float = 0.0
    # Per-document latency; overrides latency_s when it returns a value.
    latency_for: Callable[[str], float | None] = lambda _doc: None
    mode: str = OK
    # Documents containing one of these markers fail with `mode_for_marked`.
    failing_markers: tuple[str, ...] = ()
    mode_for_marked: str = HTTP_500
    model: str = "fake-reranker.gguf"
    alive: bool = True  # False: every request on a kept-alive connection is reset
    # Documents longer than this many characters get llama-server's context error.
    max_document_chars: int | None = None
    released: threading.Event = field(default_factory=threading.Event)  # ends HANG

    requests: list[dict[str, Any]] = field(default_factory=list)
    # The W3C traceparent header of each POST ("" when absent), in arrival order.
    traceparents: list[str] = field(default_factory=list)
    in_flight: int = 0
    # Set when a scoring request arrives (tests that need one in progress wait on it).
    received: threading.Event = field(default_factory=threading.Event)
    max_in_flight: int = 0
    # Calls being worked on, whoever hung up (the module docstring).
    in_hand: int = 0
    max_in_hand: int = 0
    completed: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    # Connections of HANG calls still counted in flight.
    _hanging: set[socket.socket] = field(default_factory=set)
    _server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def documents(self) -> list[str]:
        """Documents the fake was asked to score, in arrival order."""
        with self._lock:
            return [document_of(r) for r in self.requests]

    def start(self, port: int = 0) -> FakeLlamaServer:
        """Listen on 127.0.0.1:`port` (0: a free one); again after `stop` to come back."""
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # Headers and body go out as two writes; with Nagle on, delayed ACKs add
            # 40 ms to every call on a keep-alive connection.
            disable_nagle_algorithm = True

            def log_message(self, *args: Any) -> None:
                pass

            def _reset_if_dead(self) -> bool:
                if fake.alive:
                    return False
                self.close_connection = True
                self.connection.shutdown(2)
                return True

            def do_GET(self) -> None:
                if self._reset_if_dead():
                    return
                if self.path == "/health":
                    self._send(200, {"status": "ok"})
                elif self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": fake.model}]})
                else:
                    self._send(404, {"error": {"code": 404, "message": "File Not Found"}})

            def do_POST(self) -> None:
                if self._reset_if_dead():
                    return
                length = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(length))
                with fake._lock:
                    fake.traceparents.append(self.headers.get("traceparent", ""))
                if self.path != "/v1/chat/completions":
                    self._send(404, {"error": {"code": 404, "message": "File Not Found"}})
                    return
                fake._handle_chat(self, body)

            def _send(self, status: int, payload: Any, raw: bytes | None = None) -> None:
                data = raw if raw is not None else json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True  # the caller gave up on this call

        self._server = _Server(("127.0.0.1", port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.released.set()  # no handler thread outlives the test
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def kill(self) -> int:
        """Die like a crashed process: refuse new connections, reset open ones.

        Returns the port, for `start(port)` to bring it back.
        """
        port = int(self.url.rsplit(":", 1)[1])
        self.alive = False
        self.stop()
        return port

    def unhang(self) -> None:
        """Answer normally again, and let the calls left hanging end."""
        self.mode = OK
        self.released.set()

    def revive(self, port: int) -> None:
        self.alive = True
        self.start(port)

    def _handle_chat(self, handler: Any, body: dict[str, Any]) -> None:
        doc = document_of(body)
        counted = True  # in `in_flight` (the call is on the wire) until it is answered
        in_hand = True  # in `in_hand` (being worked on) until its answer is ready

        def uncount() -> None:
            nonlocal counted
            with self._lock:
                self.in_flight -= counted
                counted = False

        def ready() -> None:
            nonlocal in_hand
            with self._lock:
                self.in_hand -= in_hand
                in_hand = False

        def reply(status: int, payload: Any, raw: bytes | None = None) -> None:
            # Uncounted before the answer goes out: the caller may send its next call as
            # soon as it has read this one, before this thread runs again.
            ready()
            uncount()
            handler._send(status, payload, raw)

        with self._lock:
            # A hung call whose caller hung up is no longer on the wire: uncount it now,
            # not when its thread gets round to noticing (it shares the GIL with the
            # server under test, which may send its next call first).
            for connection in [c for c in self._hanging if _hung_up(c, wait_s=0.0)]:
                self._hanging.discard(connection)
                self.in_flight -= 1
            self.requests.append(body)
            self.in_flight += 1
            self.in_hand += 1
            self.received.set()
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self.max_in_hand = max(self.max_in_hand, self.in_hand)
        try:
            delay = self.latency_for(doc)
            time.sleep(self.latency_s if delay is None else delay)
            mode = self.mode
            if any(m in doc for m in self.failing_markers):
                mode = self.mode_for_marked
            if self.max_document_chars is not None and len(doc) > self.max_document_chars:
                mode = EXCEEDS_CONTEXT
            if mode == HANG:
                # Hang until released or until the caller hangs up: what is counted in
                # flight is what is open on the wire.
                with self._lock:
                    self._hanging.add(handler.connection)
                while not self.released.is_set() and not _hung_up(handler.connection):
                    pass
                with self._lock:
                    if handler.connection in self._hanging:
                        self._hanging.discard(handler.connection)
                    else:
                        counted = False  # a later arrival uncounted it
                handler.close_connection = True
                # Off the wire, still in hand: a model server's slot stays busy with a
                # call whose caller hung up, until the work ends (here: `unhang`, `stop`).
                self.released.wait()
                return
            if mode == EXCEEDS_CONTEXT:
                reply(
                    400,
                    {
                        "error": {
                            "code": 400,
                            "type": "exceed_context_size_error",
                            "message": "request (3120 tokens) exceeds the available context size "
                            "(2048 tokens), try increasing it",
                            "n_prompt_tokens": 3120,
                            "n_ctx": 2048,
                        }
                    },
                )
                return
            if mode == DROP_CONNECTION:
                ready()
                uncount()
                handler.close_connection = True
                handler.connection.shutdown(2)
                return
            if mode == HTTP_500:
                reply(
                    500,
                    {
                        "error": {
                            "code": 500,
                            "message": "Internal Server Error",
                            "type": "server_error",
                        }
                    },
                )
                return
            if mode == NOT_JSON:
                reply(200, None, raw=b"<html>oops</html>")
                return
            reply(200, self._chat_response(doc, mode))
        finally:
            ready()
            uncount()
            with self._lock:
                self.completed += 1

    def _chat_response(self, doc: str, mode: str) -> dict[str, Any]:
        p = next((s for marker, s in self.scores.items() if marker in doc), self.default_score)
        p = min(max(p, 1e-6), 1 - 1e-6)
        top = [("yes", math.log(p)), ("no", math.log(1 - p)), ("The", -12.0), (" Yes", -13.0)]
        if mode == NO_YES_NO:
            top = [("The", -0.5), ("Here", -1.5)]
        elif mode == ONLY_YES:
            top = [("yes", math.log(p)), ("The", -3.0)]
        top.sort(key=lambda t: -t[1])
        entries = [
            {"id": i, "token": t, "bytes": list(t.encode()), "logprob": lp}
            for i, (t, lp) in enumerate(top)
        ]
        choice: dict[str, Any] = {
            "finish_reason": "length",
            "index": 0,
            "message": {"role": "assistant", "content": top[0][0]},
        }
        if mode != NO_LOGPROBS:
            choice["logprobs"] = {"content": [{**entries[0], "top_logprobs": entries}]}
        return {
            "choices": [choice],
            "created": int(time.time()),
            "model": self.model,
            "system_fingerprint": "b0-fake",
            "object": "chat.completion",
            "usage": {"completion_tokens": 1, "prompt_tokens": 50, "total_tokens": 51},
            "id": "chatcmpl-fake",
        }


class _Server(ThreadingHTTPServer):
    # A backlog like a real server's: socketserver's 5 resets connections when several
    # clients (--workers) open many at once.
    request_queue_size = 128


def _hung_up(connection: socket.socket, wait_s: float = 0.005) -> bool:
    """Whether the peer closed `connection` (readable with nothing to read); waits a few
    milliseconds for it, so a hang-up is noticed at once."""
    readable, _, _ = select.select([connection], [], [], wait_s)
    if not readable:
        return False
    try:
        return connection.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def document_of(body: dict[str, Any]) -> str:
    """The document part of the user turn of a chat request."""
    user = next(m["content"] for m in body["messages"] if m["role"] == "user")
    match = _DOCUMENT.search(user)
    return match.group(1) if match else ""
