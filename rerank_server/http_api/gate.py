"""The JSON edge's gate: what a rerank request must pass before FastAPI sees it (token,
its limits, caps, the body read once and counted; docs/architecture.md, "The JSON edge";
docs/security.md, "Per-token limits").
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import structlog
from fastapi.responses import JSONResponse
from opentelemetry import trace
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..observability.logs import rpc_failed
from ..observability.metrics import LIMIT, RPC_METHOD, TOKEN, Metrics
from ..observability.server_spans import close_server_span, open_server_span
from ..ranking.request import RequestRules
from ..security import timeouts
from ..security.inflight_bytes import InflightBytes, Overloaded
from ..security.limits import ANONYMOUS, Admission, Caller, Refusal
from ..security.tokens import TokenSet
from . import wire
from .route import DECODED

# Open without a token: load balancers and probes carry none; the API description says
# nothing about the deployment (docs/security.md).
OPEN_PATHS = frozenset({"/health", "/openapi.json", "/docs", "/docs/oauth2-redirect"})
# Swagger UI's own files, served from the package (fastapi-offline ships them): `/docs`
# works on a machine without internet, and sends no visitor's browser to a CDN.
DOCS_ASSETS = "/docs/assets"
RERANK_PATHS = frozenset({"/v1/rerank", "/v2/rerank", "/rerank"})


class Gate:
    """ASGI middleware for the rerank routes: the token, its request rate and concurrency
    (`security/limits.py`) and the concurrency cap (less of it for a low-priority token:
    `TokenSet.places`) are checked from the headers, before any byte of the body is
    read; the token's pairs once the body is parsed. Then the body is read
    here, whole, before FastAPI sees it: each chunk is counted against
    `--max-inflight-bytes` as it arrives (429 when the server has no room), the total
    against `--max-message-bytes` (413), and the whole within `timeouts.BODY_TIMEOUT_S` (408). A
    request holds one of `max_active` places only once its body is in, so clients that
    send slowly or not at all cannot fill them, and the bytes they hold are in the
    budget."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        tokens: TokenSet,
        max_active: int,
        inflight: InflightBytes,
        max_body_bytes: int,
        rules: RequestRules,
        tracer: trace.Tracer | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self._app = app
        self._rules = rules
        self._tokens = tokens
        self.places = tokens.places(max_active)
        self._metrics = metrics or Metrics.noop()
        self._inflight = inflight
        self._max_body = max_body_bytes
        self._tracer = tracer  # None: tracing off

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
        elif self._tracer is not None and route_path(scope) in RERANK_PATHS:
            await self._traced(self._tracer, scope, receive, send)
        else:
            await self._gated(scope, receive, send)

    async def _traced(
        self, tracer: trace.Tracer, scope: Scope, receive: Receive, send: Send
    ) -> None:
        """A rerank request in a SERVER span (OpenTelemetry's HTTP conventions), a child
        of the caller's span when its headers carry one (`traceparent`), refusals
        included. Current throughout, so the request's scoring reports into it
        (`Telemetry.request_span`) and its log line carries its ids."""
        method, route = scope["method"], route_path(scope)
        opened = open_server_span(
            tracer,
            f"{method} {route}",
            Headers(scope=scope),
            {
                "http.request.method": method,
                "http.route": route,
                "url.path": scope["path"],
                "url.scheme": scope.get("scheme", "http"),
            },
        )
        status = 500  # unless a response starts

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self._gated(scope, receive, sending)
        finally:
            fault = str(status) if status >= 500 else None  # a 4xx is the caller's
            close_server_span(
                opened,
                {"http.response.status_code": status, **({"error.type": fault} if fault else {})},
                fault,
            )

    async def _gated(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[ARRIVED] = time.perf_counter()
        headers = Headers(scope=scope)
        path = route_path(scope)
        caller = (
            ANONYMOUS
            if path in OPEN_PATHS or path.startswith(f"{DOCS_ASSETS}/")
            else self._tokens.identify(headers.get("authorization"))
        )
        if caller is None:
            await _refuse(
                send,
                401,
                "missing or invalid bearer token: send 'Authorization: Bearer <token>'",
                {"WWW-Authenticate": "Bearer"},
            )
            return
        if path not in RERANK_PATHS:
            await self._app(scope, receive, send)
            return
        if scope["method"] == "POST" and not _json_type(headers.get("content-type")):
            # FastAPI would not parse it as JSON, and say only that the body is not an
            # object (curl's -d sends application/x-www-form-urlencoded). Refused from the
            # head, as the 401 is: the body is not read into the budget.
            await self._refuse(scope, send, 415, "Content-Type must be application/json", {})
            return
        if not caller.name:
            await self._limited(scope, headers, receive, send, caller)
            return
        with structlog.contextvars.bound_contextvars(token=caller.name):  # never the token
            await self._limited(scope, headers, receive, send, caller)

    async def _limited(
        self, scope: Scope, headers: Headers, receive: Receive, send: Send, caller: Caller
    ) -> None:
        """A rerank request within its token's rate and concurrency (429 when over), its
        concurrency place given back however it ends."""
        if not caller.limits.counted:
            await self._admitted(scope, headers, receive, send, caller, None)
            return
        outcome = await self._tokens.limiter.admit(caller)
        if isinstance(outcome, Refusal):
            await self._over_limit(scope, send, outcome)
            return
        try:
            await self._admitted(scope, headers, receive, send, caller, outcome)
        finally:
            outcome.release()

    async def _admitted(
        self,
        scope: Scope,
        headers: Headers,
        receive: Receive,
        send: Send,
        caller: Caller,
        admission: Admission | None,
    ) -> None:
        """Within the server's cap (by the caller's priority), the body read, its pairs
        charged to the token, then the app."""
        if await self._busy(scope, send, caller):
            return
        body = await self._read_body(scope, headers, receive, send)
        if body is None:
            return  # answered already
        try:
            # Others came in while this body arrived. The place is taken now, before the
            # pairs are charged (a round trip to a shared counter), so that no request
            # arriving meanwhile finds it free.
            if not self.places.take(caller.limits.priority):
                await self._busy(scope, send, caller)
                return
            try:
                await self._charged(scope, body, receive, send, admission)
            finally:
                self.places.leave()
        finally:
            self._inflight.give_back(len(body))

    async def _charged(
        self, scope: Scope, body: bytes, receive: Receive, send: Send, admission: Admission | None
    ) -> None:
        """The body decoded and its pairs charged to the token, then the app."""
        if scope["method"] == "POST":
            try:
                scope[DECODED] = decoded = wire.decoded(route_path(scope), body, self._rules)
            except wire.ShapeError as exc:
                await self._refuse(scope, send, 422, str(exc), {})
                return
            if admission is not None:
                refusal = await admission.charge_pairs(self._pairs(decoded))
                if refusal is not None:
                    await self._over_limit(scope, send, refusal)
                    return
        # Counted with the gRPC calls in `rerank.server.active_rpcs`, what an autoscaler
        # scales on (docs/deploy.md, "Scaling out"), by route.
        method = {RPC_METHOD: f"{scope['method']} {route_path(scope)}"}
        self._metrics.rpc_active.add(1, method)
        try:
            await self._app(scope, _replay(body, receive), send)
        finally:
            self._metrics.rpc_active.add(-1, method)

    def _pairs(self, decoded: dict[str, Any]) -> int:
        """What a request counts against its token's pairs per minute: its documents as
        received, capped at what the server scores (`--max-candidates`)."""
        documents = decoded.get("texts") or decoded.get("documents") or ()
        return min(len(documents), self._rules.max_candidates)

    async def _busy(self, scope: Scope, send: Send, caller: Caller) -> bool:
        priority = caller.limits.priority
        if self.places.free(priority):
            return False
        self._metrics.rpc_rejected.add(1, {RPC_METHOD: f"{scope['method']} {route_path(scope)}"})
        busy = self.places.busy(priority, "rerank requests")
        await self._refuse(
            scope,
            send,
            429,
            f"{busy} (max_concurrent_rpcs); retry with backoff",
            {"Retry-After": "1"},
        )
        return True

    async def _over_limit(self, scope: Scope, send: Send, refusal: Refusal) -> None:
        """429 for a token over one of its limits, counted, its `rpc` line naming it."""
        self._metrics.limit_refusals.add(1, {TOKEN: refusal.caller, LIMIT: refusal.limit})
        with structlog.contextvars.bound_contextvars(limit=refusal.limit):
            await self._refuse(
                scope, send, 429, refusal.message, {"Retry-After": str(refusal.retry_after_s)}
            )

    async def _read_body(
        self, scope: Scope, headers: Headers, receive: Receive, send: Send
    ) -> bytes | None:
        """The whole body, its bytes taken from the in-flight budget; None when the
        request was answered instead (or the client left)."""
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self._max_body:
            await self._refuse(
                scope,
                send,
                413,
                f"body of {declared} bytes exceeds the "
                f"limit of {self._max_body} (max_message_bytes)",
                _CLOSE,
            )
            return None
        chunks: list[bytes] = []
        size = 0
        whole = False  # handed over: the caller gives its bytes back
        refusal: tuple[int, str, dict[str, str]] | None = None
        try:
            async with asyncio.timeout(timeouts.BODY_TIMEOUT_S):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    chunk: bytes = message.get("body", b"")
                    if size + len(chunk) > self._max_body:
                        refusal = (
                            413,
                            f"body exceeds the limit of {self._max_body} bytes (max_message_bytes)",
                            _CLOSE,
                        )
                        break
                    self._inflight.take(len(chunk), own=size)
                    size += len(chunk)
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        whole = True
                        return b"".join(chunks)
        except TimeoutError:
            refusal = (
                408,
                f"the body did not arrive within {timeouts.BODY_TIMEOUT_S:.0f} s",
                _CLOSE,
            )
        except Overloaded as exc:
            refusal = (429, str(exc), {"Retry-After": "1", **_CLOSE})
        finally:
            # Exactly once, on every way out but the hand-over (cancellation included).
            if not whole:
                self._inflight.give_back(size)
        if refusal is not None:  # sent outside the timeout: one answer, never two
            await self._refuse(scope, send, *refusal)
        return None

    async def _refuse(
        self, scope: Scope, send: Send, status: int, message: str, headers: dict[str, str]
    ) -> None:
        """A rerank request refused before the app saw it, with its `rpc` log line (its
        `total_ms` from the head's arrival: a 408 or 422 can follow a slow body)."""
        rpc_failed(
            f"{scope['method']} {route_path(scope)}",
            "",
            scope[ARRIVED],
            str(status),
            _Refused(message),
            internal=False,
        )
        await _refuse(send, status, message, headers)


ARRIVED = "rerank.arrived"  # the scope's key for when the gate first saw the request


def route_path(scope: Scope) -> str:
    """The path the app's router matches: without the `root_path` an ASGI server or a
    mount puts in front (as Starlette's router reads it), so a rerank route is never
    reached around the gate."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root) : len(root) + 1] == "/":
        return path[len(root) :]
    return path


# After a refusal mid-body the rest of it would still be read and thrown away: hang up.
_CLOSE = {"Connection": "close"}


class _Refused(Exception):
    """Why the gate refused a request, for its log line."""


def _replay(body: bytes, receive: Receive) -> Receive:
    """`receive` for the app: the body already read, then the client's own messages (a
    disconnect)."""
    pending = True

    async def replay() -> Message:
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _refuse(
    send: Send, status: int, message: str, headers: dict[str, str] | None = None
) -> None:
    await JSONResponse({"message": message}, status, headers=headers)(
        {"type": "http"}, _no_body, send
    )


def _json_type(content_type: str | None) -> bool:
    """`application/json`, parameters aside (`; charset=utf-8`), or a `+json` type."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


async def _no_body() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}
