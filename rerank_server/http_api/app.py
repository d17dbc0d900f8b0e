"""The FastAPI application: routes, authentication, errors (docs/http.md).

(No `from __future__ import annotations` here: FastAPI reads the route annotations at
runtime, and some name closures.)

Each rerank route converts its JSON body to a domain `RerankQuery`, runs the same
pipeline as gRPC, and converts the ranked candidates back. Errors are JSON
`{"message": ...}` with the status a client expects: 422 for a request that breaks a rule
(the message names the field as the client wrote it, `documents[3].text: ...`), 401
without an accepted token, 429 when the server is busy, 413 for a body over
`--max-message-bytes`.
"""

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from importlib.resources import files
from typing import Any, NoReturn

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from opentelemetry import trace
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .. import __version__
from ..domain import BlendStrategy, Candidate, RankedCandidate, RerankQuery, RerankSummary
from ..errors import InvalidRequest
from ..observability.logs import rpc_answered, rpc_failed
from ..observability.server_spans import close_server_span, open_server_span
from ..ranking.inflight_bytes import InflightBytes, Overloaded
from ..ranking.pipeline import Reranker
from ..ranking.request import RequestRules
from ..security.tokens import TokenSet
from . import models as m
from . import wire

BackendState = Callable[[], bool | None]  # True up, False down, None not known yet


class HttpError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers


# Open without a token: load balancers and probes carry none; the API description says
# nothing about the deployment (docs/security.md).
OPEN_PATHS = frozenset({"/health", "/openapi.json", "/docs", "/docs/oauth2-redirect"})
# Swagger UI's own files, served from the package (fastapi-offline ships them): `/docs`
# works on a machine without internet, and sends no visitor's browser to a CDN.
DOCS_ASSETS = "/docs/assets"
# Said on every rerank answer that was not fully reranked, in every shape: TEI's answer is
# a bare list, so a header is its only place for it.
DEGRADED_HEADER = "X-Rerank-Degraded"
UNKNOWN_MODEL = "unknown"  # until the backend names its model (`/v1/models`, `/info`)
RERANK_PATHS = frozenset({"/v1/rerank", "/v2/rerank", "/rerank"})
# A rerank body not in by then is refused (408): a client that sends slowly, or stops,
# holds its bytes (counted against --max-inflight-bytes) and a connection no longer.
BODY_TIMEOUT_S = 30.0


class _Gate:
    """ASGI middleware for the rerank routes: the token and the concurrency cap are
    checked from the headers, before any byte of the body is read. Then the body is read
    here, whole, before FastAPI sees it: each chunk is counted against
    `--max-inflight-bytes` as it arrives (429 when the server has no room), the total
    against `--max-message-bytes` (413), and the whole within `BODY_TIMEOUT_S` (408). A
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
    ) -> None:
        self._app = app
        self._rules = rules
        self._tokens = tokens
        self._max_active = max_active
        self._inflight = inflight
        self._max_body = max_body_bytes
        self._tracer = tracer  # None: tracing off
        self.active = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
        elif self._tracer is not None and scope["path"] in RERANK_PATHS:
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
        method, route = scope["method"], scope["path"]
        opened = open_server_span(
            tracer,
            f"{method} {route}",
            Headers(scope=scope),
            {
                "http.request.method": method,
                "http.route": route,
                "url.path": route,
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
        path = scope["path"]
        if (
            path not in OPEN_PATHS
            and not path.startswith(f"{DOCS_ASSETS}/")
            and not self._tokens.accepts(headers.get("authorization"))
        ):
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
        if await self._busy(scope, send):
            return
        body = await self._read_body(scope, headers, receive, send)
        if body is None:
            return  # answered already
        try:
            if await self._busy(scope, send):  # others came in while this body arrived
                return
            try:
                shaped = (
                    wire.checked(path, body, self._rules) if scope["method"] == "POST" else body
                )
            except wire.ShapeError as exc:
                await self._refuse(scope, send, 422, str(exc), {})
                return
            self.active += 1
            try:
                await self._app(scope, _replay(shaped, receive), send)
            finally:
                self.active -= 1
        finally:
            self._inflight.give_back(len(body))

    async def _busy(self, scope: Scope, send: Send) -> bool:
        if self.active < self._max_active:
            return False
        await self._refuse(
            scope,
            send,
            429,
            f"server busy: {self.active} rerank requests "
            "in progress (max_concurrent_rpcs); retry with backoff",
            {"Retry-After": "1"},
        )
        return True

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
            async with asyncio.timeout(BODY_TIMEOUT_S):
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
            refusal = (408, f"the body did not arrive within {BODY_TIMEOUT_S:.0f} s", _CLOSE)
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
            f"{scope['method']} {scope['path']}",
            "",
            scope[ARRIVED],
            str(status),
            _Refused(message),
            internal=False,
        )
        await _refuse(send, status, message, headers)


ARRIVED = "rerank.arrived"  # the scope's key for when the gate first saw the request

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


def create_app(
    reranker: Reranker,
    *,
    tokens: TokenSet,
    inflight: InflightBytes,
    backend_up: BackendState,
    max_body_bytes: int,
    max_active: int = 256,
) -> FastAPI:
    app = FastAPI(
        title="rerank-server",
        version=__version__,
        description="Cohere/Jina- and TEI-compatible rerank API over rerank-server's "
        "pipeline: results are the model's scores blended with the retrieval "
        "order, and a failing model degrades an answer instead of failing it.",
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
        # No body limit of FastAPI's: its middleware sits outside `_Gate` and would answer
        # in plain text, and stop the gate from giving back what it counted.
        max_body_size=None,
    )
    telemetry = reranker.telemetry
    app.mount(
        DOCS_ASSETS,
        StaticFiles(directory=str(files("fastapi_offline") / "static")),
        name="docs-assets",
    )

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url="/openapi.json",
            title="rerank-server API",
            swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{DOCS_ASSETS}/favicon.png",
        )

    def model() -> str:
        return reranker.scorer.model or UNKNOWN_MODEL

    app.add_middleware(
        _Gate,
        tokens=tokens,
        max_active=max_active,
        inflight=inflight,
        max_body_bytes=max_body_bytes,
        rules=reranker.rules,
        tracer=telemetry.tracer if telemetry.tracing else None,
    )

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        rpc_failed(
            f"{request.method} {request.url.path}",
            "",
            time.perf_counter(),
            "500",
            exc,
            internal=True,
        )
        return JSONResponse({"message": "internal error"}, 500)

    @app.exception_handler(HttpError)
    async def http_error(_request: Request, exc: HttpError) -> JSONResponse:
        return JSONResponse({"message": exc.message}, exc.status, headers=exc.headers)

    @app.exception_handler(HTTPException)
    async def framework_error(_request: Request, exc: HTTPException) -> JSONResponse:
        # Starlette's own (404, 405, a body FastAPI cannot decode): the same JSON shape.
        return JSONResponse({"message": exc.detail}, exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        message = _validation_message(exc.errors())
        # Its `rpc` line, as every other refusal of a rerank request but the 401 has.
        rpc_failed(
            f"{request.method} {request.url.path}",
            "",
            time.perf_counter(),
            "422",
            ValueError(message),
            internal=False,
        )
        return JSONResponse({"message": message}, 422)

    def refuse(rpc: str, field: str, exc: InvalidRequest) -> NoReturn:
        rpc_failed(rpc, "", time.perf_counter(), "422", exc, internal=False)
        raise HttpError(422, _as_written(exc, field)) from None

    async def run(
        rpc: str,
        query: RerankQuery,
        field: str,
        response: Response,
    ) -> tuple[list[RankedCandidate], RerankSummary]:
        """The pipeline's answer (the body's bytes are in the server-wide budget: `_Gate`),
        its degraded reason in `response`'s headers."""
        started = time.perf_counter()
        try:
            _check_unicode(query, field)
            results, summary = await reranker.answer(query, None, telemetry.request_span())
            rpc_answered(rpc, summary, len(results))
            reranker.telemetry.metrics.record_rerank(summary)
            if summary.degraded is not None:
                response.headers[DEGRADED_HEADER] = summary.degraded.code.value
            return results, summary
        except InvalidRequest as exc:
            rpc_failed(
                rpc,
                reranker.rules.echoable_id(query.request_id),
                started,
                "422",
                exc,
                internal=False,
            )
            raise HttpError(422, _as_written(exc, field)) from None
        except Overloaded as exc:
            rpc_failed(
                rpc,
                reranker.rules.echoable_id(query.request_id),
                started,
                "429",
                exc,
                internal=False,
            )
            raise HttpError(429, str(exc), {"Retry-After": "1"}) from None

    async def cohere_answer(
        rpc: str, body: m.CohereRerankRequest, version: str, response: Response, echo: bool
    ) -> m.CohereRerankResponse:
        """A Cohere-shaped answer; `echo`: `return_documents` is honoured (not on
        `/rerank`, where Infinity's and vLLM's clients parse `document` differently)."""
        echoed = bool(body.return_documents) and echo
        try:
            query = _cohere_query(body)
            if echoed:
                _check_echoed(body.documents)
        except InvalidRequest as exc:
            refuse(rpc, "documents", exc)
        results, summary = await run(rpc, query, "documents", response)
        documents = body.documents if echoed else None
        return m.CohereRerankResponse(
            id=summary.request_id,
            results=[
                m.CohereResult(
                    index=r.candidate.index,
                    relevance_score=relevance,
                    document=_as_sent(documents[r.candidate.index])
                    if documents is not None
                    else None,
                    id=r.candidate.id,
                    reranker_score=r.reranker_score,
                    retrieval_rank=r.candidate.retrieval_rank,
                )
                for r, relevance in zip(results, relevance_scores(results), strict=True)
            ],
            meta=_meta(summary, version, model()),
        )

    def cohere(version: str) -> Callable[..., Awaitable[m.CohereRerankResponse]]:
        async def rerank(body: m.CohereRerankRequest, response: Response) -> m.CohereRerankResponse:
            return await cohere_answer(
                f"POST /v{version}/rerank", body, version, response, echo=True
            )

        return rerank

    for version in ("1", "2"):
        app.post(
            f"/v{version}/rerank",
            response_model=m.CohereRerankResponse,
            response_model_exclude_none=True,
            tags=["rerank"],
            summary=f"Rerank, Cohere/Jina API v{version} shape",
            responses={401: {"model": m.Error}, 422: {"model": m.Error}, 429: {"model": m.Error}},
        )(cohere(version))

    @app.post(
        "/rerank",
        response_model=list[m.TeiResult] | m.CohereRerankResponse,
        response_model_exclude_none=True,
        tags=["rerank"],
        summary="Rerank: text-embeddings-inference's shape (`texts`), or the "
        "Cohere-style one Infinity and vLLM clients send here (`documents`)",
        responses={401: {"model": m.Error}, 422: {"model": m.Error}, 429: {"model": m.Error}},
    )
    async def root_rerank(
        body: m.RootRerankRequest, response: Response
    ) -> list[m.TeiResult] | m.CohereRerankResponse:
        if isinstance(body, m.CohereRerankRequest):
            return await cohere_answer("POST /rerank", body, "1", response, echo=False)
        query = RerankQuery(
            request_id=os.urandom(16).hex(),
            query=body.query,
            candidates=tuple(
                Candidate(id=str(i), text=t, index=i, retrieval_rank=i + 1)
                for i, t in enumerate(body.texts)
            ),
            always_score=True,
        )
        results, _summary = await run("POST /rerank", query, "texts", response)
        return [
            m.TeiResult(
                index=r.candidate.index,
                score=relevance,
                text=r.candidate.text if body.return_text else None,
            )
            for r, relevance in zip(results, relevance_scores(results), strict=True)
        ]

    @app.get(
        "/health",
        response_model=m.Health,
        tags=["operations"],
        responses={503: {"model": m.Health}},
    )
    async def health() -> JSONResponse:
        up = backend_up()
        state = "starting" if up is None else "up" if up else "down"
        # Open to all, so with tokens on it keeps the model's name to `/v1/models`.
        body = m.Health(
            status="ok" if up else "unavailable",
            backend=state,  # type: ignore[arg-type]
            model="" if tokens.enabled else model(),
        )
        return JSONResponse(body.model_dump(), 200 if up else 503)

    # Some load balancers probe with HEAD (uvicorn leaves the body out). A route of its
    # own: one route with both methods gives the OpenAPI document a duplicate operation.
    @app.head("/health", include_in_schema=False)
    async def health_head() -> JSONResponse:
        return await health()

    @app.get(
        "/v1/models",
        response_model=m.ModelList,
        tags=["operations"],
        responses={401: {"model": m.Error}},
    )
    async def list_models() -> m.ModelList:
        return m.ModelList(data=[m.ModelCard(id=model(), backend=reranker.scorer.kind)])

    return app


def relevance_scores(results: Sequence[RankedCandidate]) -> list[float]:
    """What a JSON client reads as relevance, result by result in the answer's order: the
    model's own score, lowered where needed to the one before it (a running minimum), so
    that the results are sorted by it and no document scores above what the model said
    of it, whatever its retrieval rank; 0 for a document the model did not score."""
    out: list[float] = []
    ceiling = 1.0
    for r in results:
        ceiling = min(ceiling, r.reranker_score if r.reranker_score is not None else 0.0)
        out.append(ceiling)
    return out


def _as_written(exc: InvalidRequest, documents: str) -> str:
    """The core's field name as an HTTP client wrote it: `documents[3].text`, TEI's
    `texts[3]` (plain strings: no `.text`), and the top-level options (`max_candidates`,
    not `options.max_candidates`)."""

    def rename(name: str) -> str:
        name = name.removeprefix("options.")
        if not name.startswith("candidates"):
            return name
        name = documents + name[len("candidates") :]
        return name.removesuffix(".text") if documents == "texts" else name

    problem = exc.problem.replace("candidates[", f"{documents}[")
    return f"{rename(exc.field)}: {problem}"


def _bad_unicode(value: object) -> bool:
    """Whether `value` is a string no UTF-8 encoder takes (it holds a lone surrogate)."""
    if not isinstance(value, str) or value.isascii():
        return False
    try:
        value.encode()
    except UnicodeEncodeError:
        return True
    return False


def _check_echoed(documents: Sequence[str | m.Document]) -> None:
    """`return_documents` sends object documents back whole, fields the model does not
    read included: one holding a lone surrogate would fail the answer's encoding (a
    500), so it is refused, named, as the fields the model reads are."""
    for i, doc in enumerate(documents):
        if isinstance(doc, m.Document) and doc.model_extra:
            for key, value in doc.model_extra.items():
                if _bad_unicode(key) or _bad_unicode(value):
                    name = key[:64] if not _bad_unicode(key) else "(a field name)"
                    raise InvalidRequest(
                        f"candidates[{i}].{name}", "is not valid Unicode (a lone surrogate)"
                    )


def _check_unicode(query: RerankQuery, documents: str) -> None:
    """JSON can carry lone surrogates ("\\ud800"), which no UTF-8 encoder takes: refuse them
    here, naming the field, rather than fail later (protobuf already guarantees UTF-8).
    The request id too: it is echoed in the answer, whose encoding would fail (a 500)."""

    def refuse(field: str) -> None:
        raise InvalidRequest(field, "is not valid Unicode (a lone surrogate)")

    for field, value in (
        ("query", query.query),
        ("instruction", query.instruction),
        ("request_id", query.request_id),
    ):
        if _bad_unicode(value):
            refuse(field)
    for c in query.candidates:  # a field's name is spelled out only for the one that fails
        for name, value in (("id", c.id), ("text", c.text), ("title", c.title)):
            if _bad_unicode(value):
                refuse(f"candidates[{c.index}].{name}")


def _validation_message(errors: Sequence[Any]) -> str:
    """The first of pydantic's errors, as `field: problem`. A document is `str |
    Document`: for an object, the `Document` branch's error says what is wrong with it
    (the `str` branch's would only say it is not a string)."""
    if not errors:
        return "body: invalid"
    first = errors[0]
    loc = tuple(first.get("loc", ()))
    if loc[-1:] == ("str",) and isinstance(first.get("input"), dict):
        first = next((e for e in errors if "Document" in e.get("loc", ())), first)
        loc = tuple(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "")
        at = f" at character {loc[1]}" if len(loc) > 1 else ""
        return f"body: not valid JSON{at}" + (f" ({reason})" if reason else "")
    return f"{_field(loc)}: {first['msg']}"


def _field(loc: Sequence[Any]) -> str:
    """A pydantic error location as the client wrote it: `documents[3].text`."""
    out = ""
    for part in loc:
        if part == "body":
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "Document", "tei", "cohere"):  # a union's member: not a field
            continue
        else:
            out += f".{part}" if out else str(part)
    return out or "body"


def _text(doc: str | m.Document, rank_fields: list[str] | None, i: int) -> str:
    """What the model reads of a document. An object with nothing to read (no `text`, or
    none of the `rank_fields`) is refused: it was scored as an empty text."""
    if isinstance(doc, str):
        return doc
    if rank_fields:
        values = {**(doc.model_extra or {}), **doc.model_dump(exclude_none=True)}
        if not any(f in values for f in rank_fields):
            raise InvalidRequest(
                f"documents[{i}]",
                f"has none of the rank_fields ({', '.join(repr(f[:64]) for f in rank_fields)})",
            )
        return "\n".join(f"{f}: {values[f]}" for f in rank_fields if f in values)
    if doc.text is None:
        raise InvalidRequest(
            f"documents[{i}].text",
            "missing: a document given as an "
            "object needs its text (or rank_fields naming its fields)",
        )
    return doc.text


def _as_sent(doc: str | m.Document) -> dict[str, Any]:
    """`return_documents`: a document as the caller sent it (an object with all its
    fields, those sent as null too, not the `rank_fields` text the model read), as
    Cohere's API returns it."""
    if isinstance(doc, str):
        return {"text": doc}
    return doc.model_dump(exclude_unset=True)


def _default_ids(documents: Sequence[str | m.Document]) -> list[str]:
    """Each document's own id, or its index for one without; a default that another
    document gives as its id is refused, naming both (rather than reported as a
    duplicate of an id the caller never wrote)."""
    given = {d.id: i for i, d in enumerate(documents) if isinstance(d, m.Document) and d.id}
    ids: list[str] = []
    for i, doc in enumerate(documents):
        own = doc.id if isinstance(doc, m.Document) else None
        if not own and given and str(i) in given:
            raise InvalidRequest(
                f"candidates[{i}].id",
                f"not given, so its index {str(i)!r}, which "
                f"documents[{given[str(i)]}] gives as its id: give every document an id, "
                "or none",
            )
        ids.append(own or str(i))
    return ids


def _cohere_query(body: m.CohereRerankRequest) -> RerankQuery:
    candidates = []
    ids = _default_ids(body.documents)
    for i, doc in enumerate(body.documents):
        obj = doc if isinstance(doc, m.Document) else None
        candidates.append(
            Candidate(
                id=ids[i],
                text=_text(doc, body.rank_fields, i),
                index=i,
                retrieval_rank=(
                    obj.retrieval_rank if obj is not None and obj.retrieval_rank else i + 1
                ),
                title=obj.title if obj is not None else None,
                retrieval_score=obj.retrieval_score if obj is not None else None,
            )
        )
    return RerankQuery(
        request_id=body.request_id or os.urandom(16).hex(),
        query=body.query,
        candidates=tuple(candidates),
        top_k=body.top_n or 0,
        instruction=body.instruction,
        blend=BlendStrategy(body.blend_strategy) if body.blend_strategy else None,
        max_candidates=body.max_candidates,
        timeout_s=body.timeout_ms / 1000 if body.timeout_ms else None,
        # Every document gets the model's judgement (`relevance_scores`), whatever the blend.
        max_tokens_per_doc=body.max_tokens_per_doc,
        always_score=True,
    )


def _meta(s: RerankSummary, version: str, model: str) -> m.Meta:
    return m.Meta(
        api_version=m.ApiVersion(version=version),
        billed_units=m.BilledUnits(search_units=1),
        reranked=s.reranked,
        degraded=m.Degraded(code=s.degraded.code.value, message=s.degraded.message)
        if s.degraded
        else None,
        backend=s.backend,
        model=model,
        blend_strategy=s.blend.value,
        blend_profile=s.blend_profile or None,
        scored=s.scored,
        failed=s.failed,
    )
