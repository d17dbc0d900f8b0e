"""The rerank routes' class: FastAPI takes the body the gate parsed instead of parsing it.

The gate (`gate.py`) decodes a rerank body once, with msgspec (`wire.py`), and leaves the
result in the request's scope. FastAPI reads a JSON body through `Request.json()`; these
routes hand it a request whose `json()` is that result, so FastAPI validates it against
the route's pydantic model, solves the route's parameters, serializes the answer and
builds the OpenAPI document as for any route, without a second parse.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

DECODED = "rerank.decoded"  # the scope's key for the body the gate decoded


class _DecodedRequest(Request):
    async def json(self) -> Any:
        return self.scope[DECODED]


class DecodedBodyRoute(APIRoute):
    """A route whose JSON body the gate has decoded already (it is always in front)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def decoded(request: Request) -> Response:
            return await handler(_DecodedRequest(request.scope, request.receive))

        return decoded
