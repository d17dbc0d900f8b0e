"""What every HTTP backend shares: bounded concurrency, one client, failure classification.

Cancellation: when a request's budget runs out, pairs still waiting for a concurrency
slot are dropped before anything is sent, but a call already on the wire is left to finish
in the background (bounded by the per-call timeout) and its answer ignored. Cancelling
httpx calls mid-flight can leak connection-pool slots (httpcore issue #1093) until every
later call fails with PoolTimeout; the backend would finish the work anyway.

Every call is one `http.client.request.duration` sample and, with tracing on, one client
span (`POST`) carrying the backend, the instance, the pair count and the status; the
W3C `traceparent` goes out with it so a traced backend continues the trace.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any
from urllib.parse import urlsplit

import httpx
from opentelemetry import propagate, trace

from ..observability.metrics import ERROR_TYPE, HTTP_METHOD, HTTP_STATUS, Instance, Metrics
from .base import Failure

HEALTH_TIMEOUT_S = 3.0

# error.type values on metrics and spans, by failure kind.
ERROR_TYPES = {
    Failure.TIMEOUT: "timeout",
    Failure.UNAVAILABLE: "connect",
    Failure.HTTP_ERROR: "http_status",
    Failure.MALFORMED: "malformed",
}


class BackendCallError(Exception):
    """One backend call failed; `failure` says how, `detail` says what (no user text)."""

    def __init__(self, failure: Failure, detail: str, status: int = 0) -> None:
        super().__init__(detail)
        self.failure = failure
        self.detail = detail
        self.status = status


def instance_of(kind: str, base_url: str) -> Instance:
    """The instance attributes for a backend at `base_url` (host and port, no path)."""
    parts = urlsplit(base_url)
    default_port = 443 if parts.scheme == "https" else 80
    return Instance(kind, parts.hostname or "", parts.port or default_port)


def new_client(concurrency: int, timeout_s: float) -> httpx.AsyncClient:
    """One pooled client per backend; the pool is never smaller than the semaphore."""
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s))


class HttpBackend:
    """Posts JSON to one base URL with at most `concurrency` calls in flight."""

    def __init__(self, base_url: str, concurrency: int, timeout_s: float,
                 client: httpx.AsyncClient | None = None, *, kind: str = "",
                 metrics: Metrics | None = None, tracer: trace.Tracer | None = None,
                 headers: dict[str, str] | None = None, health_path: str = "/health") -> None:
        self.base_url = base_url.rstrip("/")
        self.health_path = health_path
        self._headers = dict(headers or {})
        self.instance = instance_of(kind, self.base_url)
        self._metrics = metrics or Metrics.noop()
        self._tracer = tracer or trace.NoOpTracer()
        self._client = client or new_client(concurrency, timeout_s)
        self._owns_client = client is None
        self._slots = asyncio.Semaphore(concurrency)
        self._background: set[asyncio.Task[Any]] = set()

    async def post_json(self, path: str, payload: Any, pairs: int = 1) -> Any:
        """POST `payload` (scoring `pairs` pairs), return the decoded JSON body.

        Raises BackendCallError.
        """
        async with self._slots:
            call = asyncio.ensure_future(self._traced_post(path, payload, pairs))
            self._background.add(call)
            call.add_done_callback(self._background.discard)
            try:
                return await asyncio.shield(call)
            except asyncio.CancelledError:
                # Let the call finish; nobody will read its result or exception.
                call.add_done_callback(_consume)
                raise

    async def get_json(self, path: str) -> Any:
        """GET `path` outside the scoring slots (metadata, not work); None on any failure."""
        try:
            response = await self._client.get(self.base_url + path, headers=self._headers)
            return response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, json.JSONDecodeError, UnicodeDecodeError):
            return None

    async def health(self) -> bool:
        """Whether the health path answers 200 (llama-server's `/health`: model loaded);
        always True when there is no health path to poll."""
        if not self.health_path:
            return True
        try:
            response = await self._client.get(self.base_url + self.health_path,
                                              headers=self._headers, timeout=HEALTH_TIMEOUT_S)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    def record_malformed(self) -> None:
        """Count a call whose JSON parsed but did not hold what the scorer needs."""
        self._metrics.backend_errors.add(
            1, {**self.instance.attributes, ERROR_TYPE: ERROR_TYPES[Failure.MALFORMED]})

    async def _traced_post(self, path: str, payload: Any, pairs: int) -> Any:
        attributes = self.instance.attributes
        m = self._metrics
        m.http_active.add(1, attributes)
        started = time.perf_counter()
        outcome: dict[str, str | int] = {HTTP_METHOD: "POST"}
        with self._tracer.start_as_current_span(
                "POST", kind=trace.SpanKind.CLIENT,
                attributes={**attributes, HTTP_METHOD: "POST", "url.path": path,
                            "rerank.pairs": pairs}) as span:
            try:
                headers = dict(self._headers)
                if span.is_recording():
                    propagate.inject(headers)
                body, status = await self._post(path, payload, headers)
                outcome[HTTP_STATUS] = status
                return body
            except BackendCallError as exc:
                outcome[ERROR_TYPE] = ERROR_TYPES[exc.failure]
                if exc.status:
                    outcome[HTTP_STATUS] = exc.status
                m.backend_errors.add(1, {**attributes, ERROR_TYPE: outcome[ERROR_TYPE]})
                span.set_status(trace.StatusCode.ERROR, exc.detail)
                raise
            finally:
                span.set_attributes(outcome)
                m.http_active.add(-1, attributes)
                m.http_duration.record(time.perf_counter() - started, {**attributes, **outcome})

    async def _post(self, path: str, payload: Any, headers: dict[str, str]) -> tuple[Any, int]:
        url = self.base_url + path
        try:
            response = await self._client.post(url, json=payload, headers=headers)
        except httpx.TimeoutException as exc:
            raise BackendCallError(Failure.TIMEOUT, type(exc).__name__) from None
        except httpx.TransportError as exc:
            raise BackendCallError(Failure.UNAVAILABLE, type(exc).__name__) from None
        status = response.status_code
        if status >= 400:
            raise BackendCallError(Failure.HTTP_ERROR, f"HTTP {status}", status)
        try:
            return response.json(), status
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise BackendCallError(Failure.MALFORMED, "response is not JSON", status) from None

    async def aclose(self) -> None:
        """Wait for calls left running by cancelled requests, then close the pool."""
        if self._background:
            await asyncio.wait(list(self._background))
        if self._owns_client:
            await self._client.aclose()


def _consume(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()
