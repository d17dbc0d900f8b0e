"""What every HTTP backend shares: bounded concurrency, one client, failure classification.

Cancellation: when a request's budget runs out, pairs still waiting for a concurrency
slot are dropped before anything is sent, but a call already on the wire is left to finish
in the background (bounded by the per-call timeout) and its answer ignored. Cancelling
httpx calls mid-flight can leak connection-pool slots (httpcore issue #1093) until every
later call fails with PoolTimeout; the backend would finish the work anyway.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx

from .base import Failure, PairOutcome

T = TypeVar("T")


class BackendCallError(Exception):
    """One backend call failed; `failure` says how, `detail` says what (no user text)."""

    def __init__(self, failure: Failure, detail: str) -> None:
        super().__init__(detail)
        self.failure = failure
        self.detail = detail


def new_client(concurrency: int, timeout_s: float) -> httpx.AsyncClient:
    """One pooled client per backend; the pool is never smaller than the semaphore."""
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s))


class HttpBackend:
    """Posts JSON to one base URL with at most `concurrency` calls in flight."""

    def __init__(self, base_url: str, concurrency: int, timeout_s: float,
                 client: httpx.AsyncClient | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._client = client or new_client(concurrency, timeout_s)
        self._owns_client = client is None
        self._slots = asyncio.Semaphore(concurrency)
        self._background: set[asyncio.Task[Any]] = set()

    async def post_json(self, path: str, payload: Any) -> Any:
        """POST `payload`, return the decoded JSON body; raises BackendCallError."""
        async with self._slots:
            call = asyncio.ensure_future(self._post(path, payload))
            self._background.add(call)
            call.add_done_callback(self._background.discard)
            try:
                return await asyncio.shield(call)
            except asyncio.CancelledError:
                # Let the call finish; nobody will read its result or exception.
                call.add_done_callback(_consume)
                raise

    async def map_pairs(self, count: int, one: Callable[[int], Awaitable[PairOutcome]],
                        emit: Callable[[PairOutcome], None]) -> None:
        """Run `one(i)` for every pair concurrently, emitting each outcome as it lands."""
        async with asyncio.TaskGroup() as group:
            for i in range(count):
                group.create_task(_emit_after(one(i), emit))

    async def _post(self, path: str, payload: Any) -> Any:
        url = self.base_url + path
        try:
            response = await self._client.post(url, json=payload)
        except httpx.TimeoutException as exc:
            raise BackendCallError(Failure.TIMEOUT, type(exc).__name__) from None
        except httpx.TransportError as exc:
            raise BackendCallError(Failure.UNAVAILABLE, type(exc).__name__) from None
        if response.status_code >= 400:
            raise BackendCallError(Failure.HTTP_ERROR, f"HTTP {response.status_code}")
        try:
            return response.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise BackendCallError(Failure.MALFORMED, "response is not JSON") from None

    async def aclose(self) -> None:
        """Wait for calls left running by cancelled requests, then close the pool."""
        if self._background:
            await asyncio.wait(list(self._background))
        if self._owns_client:
            await self._client.aclose()


async def _emit_after(outcome: Awaitable[PairOutcome], emit: Callable[[PairOutcome], None]) -> None:
    emit(await outcome)


def _consume(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()
