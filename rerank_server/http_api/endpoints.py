"""The JSON edge's endpoints: one method per route, over the same pipeline as gRPC.

(No `from __future__ import annotations`: FastAPI reads the endpoints' annotations at
runtime.)
"""

import time
from typing import NoReturn

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from ..domain import BlendStrategy, RankedCandidate, RerankQuery, RerankSummary
from ..errors import InvalidRequest
from ..observability.logs import rpc_failed
from ..observability.telemetry import Telemetry
from ..ranking.request import RequestRules
from ..ranking.served_models import ServedModel, ServedModels, UnknownModel
from ..security.inflight_bytes import Overloaded
from ..security.tokens import TokenSet
from . import models as m
from .convert import (
    as_written,
    check_echoed,
    check_unicode,
    cohere_answer,
    cohere_query,
    degraded_header,
    tei_query,
    tei_results,
)
from .gate import ARRIVED

# Said on every rerank answer that was not fully reranked, in every shape: TEI's answer is
# a bare list, so a header is its only place for it. Every reason, comma-separated.
DEGRADED_HEADER = "X-Rerank-Degraded"
# The blend behind `relevance_score` / `score`, on every rerank answer (TEI's too).
BLEND_HEADER = "X-Rerank-Blend"
UNKNOWN_MODEL = "unknown"  # until the backend names its model (`/v1/models`, `/info`)


class HttpError(Exception):
    """A refusal with its HTTP status, message and headers (`{"message": ...}`)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers


def arrived(request: Request) -> float:
    """When the gate first saw `request` (now, for one that did not pass it): what every
    log line of the request measures its `total_ms` from."""
    started = request.scope.get(ARRIVED)
    return started if isinstance(started, float) else time.perf_counter()


class RerankEndpoints:
    """The rerank routes, Cohere/Jina's and TEI's shapes, and what each answer says of the
    pipeline's (headers, the model's name)."""

    def __init__(
        self,
        models: ServedModels,
        telemetry: Telemetry,
        rules: RequestRules,
        default_blend: BlendStrategy,
    ) -> None:
        self.models = models
        self._telemetry = telemetry
        self._rules = rules
        self._default_blend = default_blend

    async def cohere_v1(
        self, body: m.CohereRerankRequest, request: Request, response: Response
    ) -> m.CohereRerankResponse:
        """`POST /v1/rerank`: Cohere's v1 and Jina's shape."""
        return await self._cohere("POST /v1/rerank", body, "1", request, response, echo=True)

    async def cohere_v2(
        self, body: m.CohereRerankRequest, request: Request, response: Response
    ) -> m.CohereRerankResponse:
        """`POST /v2/rerank`: Cohere's v2 shape."""
        return await self._cohere("POST /v2/rerank", body, "2", request, response, echo=True)

    async def root(
        self, body: m.RootRerankRequest, request: Request, response: Response
    ) -> list[m.TeiResult] | m.CohereRerankResponse:
        """`POST /rerank`: TEI's body (`texts`), or the Cohere-style one Infinity's and
        vLLM's clients send here (`documents`), answered without `document`, which the
        two parse differently."""
        if isinstance(body, m.CohereRerankRequest):
            return await self._cohere("POST /rerank", body, "1", request, response, echo=False)
        query = tei_query(body, self._default_blend)
        results, _ = await self._run("POST /rerank", query, "texts", request, response, None)
        return tei_results(results, body.return_text)

    async def _cohere(
        self,
        rpc: str,
        body: m.CohereRerankRequest,
        version: str,
        request: Request,
        response: Response,
        echo: bool,
    ) -> m.CohereRerankResponse:
        """A Cohere-shaped answer; `echo`: `return_documents` is honoured."""
        echoed = bool(body.return_documents) and echo
        try:
            query = cohere_query(body, self._default_blend)
            if echoed:
                check_echoed(body.documents)
        except InvalidRequest as exc:
            self._refuse(rpc, "", request, "documents", exc)
        results, summary = await self._run(rpc, query, "documents", request, response, body.model)
        documents = body.documents if echoed else None
        return cohere_answer(results, summary, version, summary.model or UNKNOWN_MODEL, documents)

    async def _run(
        self,
        rpc: str,
        query: RerankQuery,
        field: str,
        request: Request,
        response: Response,
        model: str | None,
    ) -> tuple[list[RankedCandidate], RerankSummary]:
        """The answer of the pipeline of the model named `model` (the body's bytes are in
        the server-wide budget: `Gate`), what it says in `response`'s headers."""
        try:
            served = self.models.select(model)
            check_unicode(query, field)
            results, summary = await served.reranker.answer(
                query, None, self._telemetry.request_span()
            )
        except UnknownModel as exc:
            rpc_failed(rpc, self._echoable(query), arrived(request), "404", exc, internal=False)
            raise HttpError(404, str(exc)) from None
        except InvalidRequest as exc:
            self._refuse(rpc, query.request_id, request, field, exc)
        except Overloaded as exc:
            rpc_failed(rpc, self._echoable(query), arrived(request), "429", exc, internal=False)
            raise HttpError(429, str(exc), {"Retry-After": "1"}) from None
        self._telemetry.answered(rpc, summary, len(results))
        if (reasons := degraded_header(summary)) is not None:
            response.headers[DEGRADED_HEADER] = reasons
        response.headers[BLEND_HEADER] = summary.blend.value
        return results, summary

    def _refuse(
        self, rpc: str, request_id: str, request: Request, field: str, exc: InvalidRequest
    ) -> NoReturn:
        """422 naming the field as the client wrote it, with its `rpc` log line."""
        echoable = self._rules.echoable_id(request_id)
        rpc_failed(rpc, echoable, arrived(request), "422", exc, internal=False)
        raise HttpError(422, as_written(exc, field)) from None

    def _echoable(self, query: RerankQuery) -> str:
        return self._rules.echoable_id(query.request_id)


class OperationEndpoints:
    """`/health` and `/v1/models`: whether this replica can rerank now, and what with."""

    def __init__(self, models: ServedModels, tokens: TokenSet) -> None:
        self._models = models
        self._tokens = tokens

    async def health(self) -> JSONResponse:
        """200 while the default model's backend can score, else 503 (each model's own
        state under `models`, with several); open to all, so with tokens on it keeps the
        models' names to `/v1/models`."""
        default = self._models.default
        up = default.backend_up()
        named = not self._tokens.enabled
        body = m.Health(
            status="ok" if up else "unavailable",
            backend=_state(up),
            model=_name(default) if named else "",
            models=(
                {_name(s): _state(s.backend_up()) for s in self._models}
                if named and len(self._models.models) > 1
                else None
            ),
        )
        return JSONResponse(body.model_dump(exclude_none=True), 200 if up else 503)

    async def models(self) -> m.ModelList:
        """Every served model, the default first."""
        served = sorted(self._models, key=lambda s: s is not self._models.default)
        return m.ModelList(
            data=[
                m.ModelCard(id=_name(s), backend=s.kind, aliases=list(s.aliases) or None)
                for s in served
            ]
        )


def _name(served: ServedModel) -> str:
    """The model's name, the same in every answer, `/health` and `/v1/models`."""
    return served.model or UNKNOWN_MODEL


def _state(up: bool | None) -> m.BackendState:
    return "starting" if up is None else "up" if up else "down"
