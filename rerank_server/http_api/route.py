"""The rerank routes' class: FastAPI takes the body the gate parsed instead of parsing it."""

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
    """A route whose JSON body the gate has decoded already (it is always in front).

    The gate leaves its parse in the request's scope, and FastAPI reads a JSON body
    through `Request.json()`: handed a request whose `json()` is that parse, FastAPI
    validates it, solves the route's parameters, serializes the answer and builds the
    OpenAPI document as for any route, without parsing the bytes again.
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def decoded(request: Request) -> Response:
            return await handler(_DecodedRequest(request.scope, request.receive))

        return decoded
