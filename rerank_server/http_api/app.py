"""The FastAPI application: the routes and their errors (docs/http.md).

A rerank request reaches a route through the gate (`gate.py`: token, concurrency cap,
body read and counted); the route converts it (`convert.py`), runs the pipeline and
converts the answer back, as the gRPC edge does. Errors are JSON `{"message": ...}` with
the status a client expects: 422 for a request that breaks a rule (the message names
the field as the client wrote it, `documents[3].text: ...`), 401 without an accepted
token, 429 when the server is busy, 413 for a body over `--max-message-bytes`.

(No `from __future__ import annotations` here: FastAPI reads the route annotations at
runtime, and some name closures.)
"""

import time
from collections.abc import Awaitable, Callable
from importlib.resources import files
from typing import Any, NoReturn

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException

from .. import __version__
from ..domain import BlendStrategy, RankedCandidate, RerankQuery, RerankSummary
from ..errors import InvalidRequest
from ..observability.logs import rpc_failed
from ..observability.telemetry import Telemetry
from ..ranking.pipeline import Reranker
from ..ranking.request import RequestRules
from ..scoring.base import Scorer
from ..security.inflight_bytes import InflightBytes, Overloaded
from ..security.tokens import TokenSet
from . import models as m
from .convert import (
    answer_meta,
    as_sent,
    as_written,
    check_echoed,
    check_unicode,
    cohere_query,
    degraded_header,
    relevance,
    tei_query,
    tei_results,
    validation_message,
)
from .gate import DOCS_ASSETS, Gate
from .route import DecodedBodyRoute

# Said on every rerank answer that was not fully reranked, in every shape: TEI's answer is
# a bare list, so a header is its only place for it. Every reason, comma-separated.
DEGRADED_HEADER = "X-Rerank-Degraded"
# The blend behind `relevance_score` / `score`, on every rerank answer (TEI's too).
BLEND_HEADER = "X-Rerank-Blend"
UNKNOWN_MODEL = "unknown"  # until the backend names its model (`/v1/models`, `/info`)

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


def create_app(
    reranker: Reranker,
    *,
    telemetry: Telemetry,
    rules: RequestRules,
    scorer: Scorer,
    tokens: TokenSet,
    inflight: InflightBytes,
    backend_up: BackendState,
    max_body_bytes: int,
    max_active: int = 256,
    default_blend: BlendStrategy = BlendStrategy.RERANK_ONLY,
) -> FastAPI:
    app = FastAPI(
        title="rerank-server",
        version=__version__,
        description="Cohere/Jina- and TEI-compatible rerank API over rerank-server's "
        "pipeline: results in the model's order with its scores (or a blend with the "
        "retrieval order, on request), and a failing model degrades an answer instead "
        "of failing it.",
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
        # No body limit of FastAPI's: its middleware sits outside `Gate` and would answer
        # in plain text, and stop the gate from giving back what it counted.
        max_body_size=None,
    )
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
        return scorer.model or UNKNOWN_MODEL

    app.add_middleware(
        Gate,
        tokens=tokens,
        max_active=max_active,
        inflight=inflight,
        max_body_bytes=max_body_bytes,
        rules=rules,
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
        message = validation_message(exc.errors())
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
        raise HttpError(422, as_written(exc, field)) from None

    async def run(
        rpc: str,
        query: RerankQuery,
        field: str,
        response: Response,
    ) -> tuple[list[RankedCandidate], RerankSummary]:
        """The pipeline's answer (the body's bytes are in the server-wide budget: `Gate`),
        its degraded reason in `response`'s headers."""
        started = time.perf_counter()
        try:
            check_unicode(query, field)
            results, summary = await reranker.answer(query, None, telemetry.request_span())
            telemetry.answered(rpc, summary, len(results))
            if (reasons := degraded_header(summary)) is not None:
                response.headers[DEGRADED_HEADER] = reasons
            response.headers[BLEND_HEADER] = summary.blend.value
            return results, summary
        except InvalidRequest as exc:
            rpc_failed(
                rpc,
                rules.echoable_id(query.request_id),
                started,
                "422",
                exc,
                internal=False,
            )
            raise HttpError(422, as_written(exc, field)) from None
        except Overloaded as exc:
            rpc_failed(
                rpc,
                rules.echoable_id(query.request_id),
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
            query = cohere_query(body, default_blend)
            if echoed:
                check_echoed(body.documents)
        except InvalidRequest as exc:
            refuse(rpc, "documents", exc)
        results, summary = await run(rpc, query, "documents", response)
        documents = body.documents if echoed else None
        return m.CohereRerankResponse(
            id=summary.request_id,
            results=[
                m.CohereResult(
                    index=r.candidate.index,
                    relevance_score=relevance(r),
                    document=as_sent(documents[r.candidate.index])
                    if documents is not None
                    else None,
                    id=r.candidate.id,
                    reranker_score=r.reranker_score,
                    retrieval_rank=r.candidate.retrieval_rank,
                )
                for r in results
            ],
            meta=answer_meta(summary, version, model()),
        )

    def cohere(version: str) -> Callable[..., Awaitable[m.CohereRerankResponse]]:
        async def rerank(body: m.CohereRerankRequest, response: Response) -> m.CohereRerankResponse:
            return await cohere_answer(
                f"POST /v{version}/rerank", body, version, response, echo=True
            )

        return rerank

    refusals: dict[int | str, dict[str, Any]] = {
        401: {"model": m.Error},
        422: {"model": m.Error},
        429: {"model": m.Error},
    }
    for version in ("1", "2"):
        app.router.add_api_route(
            f"/v{version}/rerank",
            cohere(version),
            methods=["POST"],
            response_model=m.CohereRerankResponse,
            response_model_exclude_none=True,
            tags=["rerank"],
            summary=f"Rerank, Cohere/Jina API v{version} shape",
            responses=refusals,
            route_class_override=DecodedBodyRoute,
        )

    async def root_rerank(
        body: m.RootRerankRequest, response: Response
    ) -> list[m.TeiResult] | m.CohereRerankResponse:
        if isinstance(body, m.CohereRerankRequest):
            return await cohere_answer("POST /rerank", body, "1", response, echo=False)
        results, _summary = await run(
            "POST /rerank", tei_query(body, default_blend), "texts", response
        )
        return tei_results(results, body.return_text)

    app.router.add_api_route(
        "/rerank",
        root_rerank,
        methods=["POST"],
        response_model=list[m.TeiResult] | m.CohereRerankResponse,
        response_model_exclude_none=True,
        tags=["rerank"],
        summary="Rerank: text-embeddings-inference's shape (`texts`), or the "
        "Cohere-style one Infinity and vLLM clients send here (`documents`)",
        responses=refusals,
        route_class_override=DecodedBodyRoute,
    )

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
        return m.ModelList(data=[m.ModelCard(id=model(), backend=scorer.kind)])

    return app
