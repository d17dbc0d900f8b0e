"""The FastAPI application: the endpoints' routes, their errors and the API's documents.

(No `from __future__ import annotations`: FastAPI reads the handlers' annotations at
runtime.)
"""

from importlib.resources import files
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException

from .. import __version__
from ..domain import BlendStrategy
from ..observability.logs import rpc_failed
from ..observability.telemetry import Telemetry
from ..ranking.request import RequestRules
from ..ranking.served_models import ServedModels
from ..security.inflight_bytes import InflightBytes
from ..security.tokens import TokenSet
from . import models as m
from .convert import validation_message
from .endpoints import (
    BLEND_HEADER,
    DEGRADED_HEADER,
    HttpError,
    OperationEndpoints,
    RerankEndpoints,
    arrived,
)
from .gate import DOCS_ASSETS, Gate
from .route import DecodedBodyRoute

__all__ = ["BLEND_HEADER", "DEGRADED_HEADER", "create_app"]

REFUSALS: dict[int | str, dict[str, Any]] = {
    401: {"model": m.Error},
    404: {"model": m.Error},
    422: {"model": m.Error},
    429: {"model": m.Error},
}


def create_app(
    models: ServedModels,
    *,
    telemetry: Telemetry,
    rules: RequestRules,
    tokens: TokenSet,
    inflight: InflightBytes,
    max_body_bytes: int,
    max_active: int = 256,
    default_blend: BlendStrategy = BlendStrategy.RERANK_ONLY,
) -> FastAPI:
    """The JSON API over the served `models`, behind the gate (token, caps, the body's one read)."""
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
    app.add_middleware(
        Gate,
        tokens=tokens,
        max_active=max_active,
        inflight=inflight,
        max_body_bytes=max_body_bytes,
        rules=rules,
        tracer=telemetry.tracer if telemetry.tracing else None,
        metrics=telemetry.metrics,
    )
    app.add_exception_handler(Exception, unexpected)
    app.add_exception_handler(HttpError, http_error)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, framework_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, invalid_body)  # type: ignore[arg-type]
    add_rerank_routes(app, RerankEndpoints(models, telemetry, rules, default_blend))
    add_operation_routes(app, OperationEndpoints(models, tokens))
    add_docs(app)
    return app


def add_rerank_routes(app: FastAPI, rerank: RerankEndpoints) -> None:
    """`/v1/rerank`, `/v2/rerank` and `/rerank`, their bodies decoded by the gate."""
    for path, endpoint, summary, model in (
        ("/v1/rerank", rerank.cohere_v1, "Rerank, Cohere/Jina API v1 shape", None),
        ("/v2/rerank", rerank.cohere_v2, "Rerank, Cohere/Jina API v2 shape", None),
        (
            "/rerank",
            rerank.root,
            "Rerank: text-embeddings-inference's shape (`texts`), or the Cohere-style one "
            "Infinity and vLLM clients send here (`documents`)",
            list[m.TeiResult] | m.CohereRerankResponse,
        ),
    ):
        app.router.add_api_route(
            path,
            endpoint,
            methods=["POST"],
            response_model=model or m.CohereRerankResponse,
            response_model_exclude_none=True,
            tags=["rerank"],
            summary=summary,
            responses=REFUSALS,
            route_class_override=DecodedBodyRoute,
        )


def add_operation_routes(app: FastAPI, operations: OperationEndpoints) -> None:
    """`/health` (and its HEAD, for load balancers that probe so) and `/v1/models`."""
    app.router.add_api_route(
        "/health",
        operations.health,
        methods=["GET"],
        response_model=m.Health,
        tags=["operations"],
        responses={503: {"model": m.Health}},
    )
    # A route of its own: one route with both methods gives the OpenAPI document a
    # duplicate operation.
    app.router.add_api_route(
        "/health", operations.health, methods=["HEAD"], include_in_schema=False
    )
    app.router.add_api_route(
        "/v1/models",
        operations.models,
        methods=["GET"],
        response_model=m.ModelList,
        response_model_exclude_none=True,
        tags=["operations"],
        responses={401: {"model": m.Error}},
    )


def add_docs(app: FastAPI) -> None:
    """`/docs`: Swagger UI with its script and style served from the package (no CDN)."""
    app.mount(
        DOCS_ASSETS,
        StaticFiles(directory=str(files("fastapi_offline") / "static")),
        name="docs-assets",
    )

    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url="/openapi.json",
            title="rerank-server API",
            swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{DOCS_ASSETS}/favicon.png",
        )

    app.router.add_api_route("/docs", docs, methods=["GET"], include_in_schema=False)


async def unexpected(request: Request, exc: Exception) -> JSONResponse:
    """A bug: 500, logged with its stack (never the message, which may hold user text)."""
    rpc = f"{request.method} {request.url.path}"
    rpc_failed(rpc, "", arrived(request), "500", exc, internal=True)
    return JSONResponse({"message": "internal error"}, 500)


async def http_error(_request: Request, exc: HttpError) -> JSONResponse:
    return JSONResponse({"message": exc.message}, exc.status, headers=exc.headers)


async def framework_error(_request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own (404, 405, a body FastAPI cannot decode), in the same JSON shape."""
    return JSONResponse({"message": exc.detail}, exc.status_code, headers=exc.headers)


async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
    """422 for a body that is not the documented shape, with its `rpc` log line, as every
    other refusal of a rerank request but the 401 has."""
    message = validation_message(exc.errors())
    rpc = f"{request.method} {request.url.path}"
    rpc_failed(rpc, "", arrived(request), "422", ValueError(message), internal=False)
    return JSONResponse({"message": message}, 422)
