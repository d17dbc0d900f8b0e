"""The client of one backend instance: calls bounded by its slots, abandoned rather than
cancelled, and a side client for health and metadata (docs/architecture.md, "Transport").
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import httpx
import msgspec
import orjson
from opentelemetry import trace

from ... import __version__
from ...observability.metrics import ERROR_TYPE, HTTP_METHOD, HTTP_STATUS, Instance, Metrics
from ..base import Failure
from ..calls import CallTasks
from . import lean, trace_context
from .errors import ERROR_TYPES, BackendCallError, Decode, MalformedResponse, physical_batch
from .errors import too_long as refused_as_too_long

USER_AGENT = f"rerank-server/{__version__}"
HEALTH_TIMEOUT_S = 3.0  # a health poll or metadata GET, whole: head and body
SIDE_CONNECTIONS = 2  # the side client's: health polls, `/props`, `/v1/models`
SIDE_MAX_BYTES = 1024 * 1024  # a metadata answer (/v1/models, /props) read at most
HEALTH_MAX_BYTES = 64 * 1024  # a health answer, read whole so its connection is kept
ABANDON_MIN_S = 1.0  # an abandoned call may always run this long
ABANDON_UNKNOWN_S = 2.0  # ... and this long before any call has answered
ABANDON_LATENCIES = 4.0  # ... else this many times the recent call latency


def instance_of(kind: str, base_url: str) -> Instance:
    """The instance attributes for a backend at `base_url` (host and port, no path)."""
    parts = urlsplit(base_url)
    default_port = 443 if parts.scheme == "https" else 80
    return Instance(kind, parts.hostname or "", parts.port or default_port)


async def _read_bounded(response: httpx.Response, limit: int) -> tuple[int, bytes]:
    """A streamed answer's status and body, read raw and decoded here, each at most
    `limit` bytes (httpx.DecodingError past it): httpx's own reading bounds neither."""
    body = bytearray()
    async for part in response.aiter_raw():
        body += part
        if len(body) > limit:
            raise httpx.DecodingError("answer too large")
    return response.status_code, lean.decoded(response.headers.raw, bytes(body), limit)


def new_client(
    concurrency: int,
    timeout_s: float,
    loopback: bool = False,
) -> httpx.AsyncClient:
    """The pooled client for backends off the lean transport (`https://`, proxied): its
    pool is never smaller than the semaphore, so at most `concurrency` calls are on the
    wire (`HttpBackend`'s slots). To `loopback`, never through a proxy."""
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    return httpx.AsyncClient(
        limits=limits,
        timeout=httpx.Timeout(timeout_s),
        transport=_unproxied(limits) if loopback else None,
    )


def _unproxied(limits: httpx.Limits) -> httpx.AsyncHTTPTransport:
    """A transport of our own: httpx then takes no proxy from the environment, and
    still reads the rest of it (SSL_CERT_FILE for a private CA; `trust_env=False` would
    drop that too)."""
    return httpx.AsyncHTTPTransport(limits=limits)


Outcome = Callable[[BackendCallError | None], None]


class HttpBackend:
    """Posts JSON to one base URL with at most `concurrency` calls in flight."""

    def __init__(
        self,
        base_url: str,
        concurrency: int,
        timeout_s: float,
        *,
        kind: str = "",
        metrics: Metrics | None = None,
        tracer: trace.Tracer | None = None,
        headers: dict[str, str] | None = None,
        health_path: str = "/health",
        trace_calls: bool = False,
        calls: CallTasks | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.calls = calls or CallTasks()  # the pool's, shared by its instances
        self.health_path = health_path
        # Identity: an answer need not be decoded, and one that is anyway is decoded
        # with a bound (`lean.decoded`).
        self._headers = {"user-agent": USER_AGENT, "accept-encoding": "identity", **(headers or {})}
        for name, value in self._headers.items():
            if any(c in name + value for c in "\r\n\0"):
                raise ValueError(f"header {name!r} holds a line break or NUL")
        self._urls: dict[str, httpx.URL] = {}
        self._heads: dict[str, bytes] = {}  # path -> request head up to the length
        self.instance = instance_of(kind, self.base_url)
        self._metrics = metrics or Metrics.noop()
        self._tracer = tracer or trace.NoOpTracer()
        self._trace_calls = trace_calls  # a client span per call (--trace-backend-calls)
        self._timeout_s = timeout_s
        # Plain HTTP: requests go straight to the lean transport as bytes, the head kept
        # per path (`_head`). httpx's client adds per call a header and cookie merge,
        # auth and redirect handling and cookie extraction, and its request and response
        # objects normalize every header: none of it is used, and together it was most
        # of a call's CPU (docs/decisions.md). Otherwise httpx's client with its own
        # transport, proxies and TLS settings.
        self._lean = (
            lean.LeanTransport(max_idle=concurrency) if lean.wanted(self.base_url) else None
        )
        self._client = (
            new_client(concurrency, timeout_s, lean.loopback(self.base_url))
            if self._lean is None
            else None
        )
        base = httpx.URL(self.base_url)
        self._address = (base.host, base.port or 80)
        side_limits = httpx.Limits(max_connections=SIDE_CONNECTIONS, max_keepalive_connections=1)
        self._side_client = httpx.AsyncClient(
            limits=side_limits,
            timeout=httpx.Timeout(HEALTH_TIMEOUT_S),
            transport=_unproxied(side_limits) if lean.loopback(self.base_url) else None,
        )
        self._side_slots = asyncio.Semaphore(SIDE_CONNECTIONS)  # see `_side_get`
        self.concurrency = concurrency
        self._slots = asyncio.Semaphore(concurrency)
        self._calls: dict[asyncio.Future[Any], float] = {}  # call on the wire -> sent at
        self._given_up: set[asyncio.Future[Any]] = set()  # abandoned, past the leash: reported
        # What admission estimates read (pool.BackendPool.estimate_s).
        self.queued_pairs = 0
        self.in_flight_pairs = 0
        self.waiting = 0  # calls waiting for a slot
        self.latency_s: float | None = None  # recent latency of answered calls (EWMA)
        self.pair_s: float | None = None  # ... per pair in the call
        self.abandoned = 0  # abandoned calls still running
        # Every call's end, for the pool's ejection bookkeeping: None = answered.
        self.on_outcome: Outcome = lambda _failure: None
        attributes = self.instance.attributes
        self._metrics.watch_active(self, lambda: (len(self._calls), attributes))

    async def post_json(
        self, path: str, payload: Any, pairs: int = 1, decode: Decode = orjson.loads
    ) -> Any:
        """POST `payload` (scoring `pairs` pairs), return the decoded JSON body: by orjson,
        or by `decode` (a scorer's typed decoder of only the fields it reads).

        Raises BackendCallError. If the caller is cancelled, the call is abandoned (see
        the module docstring) and keeps its slot until it ends. A task registered with
        `calls.own` makes the call itself: it is to be let go (`let_go`), not cancelled.
        """
        task = asyncio.current_task()
        tasks = self.calls
        own = tasks.owns(task)
        if own and tasks.is_let_go(task):
            raise asyncio.CancelledError  # let go: no further call
        self.queued_pairs += pairs
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.queued_pairs -= pairs
            self.waiting -= 1
        loop = asyncio.get_running_loop()
        if own:
            assert task is not None
            self._calls[task] = loop.time()
            tasks.on_wire(task, self._abandon)
            try:
                body = await self._send_reporting(path, payload, pairs, decode)
            except BackendCallError:
                if tasks.is_let_go(task):  # a failure nobody waits for: no split, no retry
                    raise asyncio.CancelledError from None
                raise
            finally:
                tasks.off_wire(task)
                self._forget(task)
            if tasks.is_let_go(task):
                # Let go while its call was on the wire: the answer came within the
                # leash, but nobody waits for what the task would do with it (a scorer
                # would go on to score, in tasks of its own that are not let go).
                raise asyncio.CancelledError
            return body
        call = loop.create_task(self._send_reporting(path, payload, pairs, decode))
        self._calls[call] = loop.time()
        # Released when the call ends however it ends, even cancelled before it started.
        call.add_done_callback(self._forget)
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            if not call.done():
                self._abandon(call)
            raise

    def _forget(self, call: asyncio.Future[Any]) -> None:
        self._calls.pop(call, None)
        self._given_up.discard(call)
        self._slots.release()

    @property
    def stuck(self) -> bool:
        """Whether every slot is held by a call past its leash: the backend has taken
        all it may have and answers none (a hung one), and no further call can be sent
        to count as one more failure."""
        return len(self._given_up) >= self.concurrency

    @property
    def load(self) -> float:
        """Calls holding or waiting for a slot, abandoned ones included, per slot: what
        balancing compares (a hung instance full of abandoned calls is not idle)."""
        return (len(self._calls) + self.waiting) / self.concurrency

    async def _send_reporting(
        self, path: str, payload: Any, pairs: int, decode: Decode = orjson.loads
    ) -> Any:
        """One call, from holding its slot to releasing it; reports how it ended."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        self.in_flight_pairs += pairs
        ended: tuple[BackendCallError | None] | None = None  # None: not to be reported
        try:
            try:
                body = await self._send_measured(path, payload, pairs, decode)
            except MalformedResponse:
                # An answer, if not a usable one: the instance answered (as when the
                # scorer's parser finds the shape wrong, after the call).
                ended = self._answered(pairs, started)
                raise
            ended = self._answered(pairs, started)
            return body
        except BackendCallError as exc:
            ended = (exc,)
            raise
        finally:
            self.in_flight_pairs -= pairs
            # A call past its leash was reported a timeout then (`_abandon`).
            if ended is not None and asyncio.current_task() not in self._given_up:
                self.on_outcome(ended[0])

    def _answered(self, pairs: int, started: float) -> tuple[None] | None:
        """A scoring call answered: its time feeds the latency figures and its outcome
        clears the failure streak. Metadata calls (pairs=0: /tokenize, /apply-template)
        take no slot on llama-server: their speed and their answers say nothing about
        scoring, so they do neither (None: nothing to report)."""
        if not pairs:
            return None
        elapsed = asyncio.get_running_loop().time() - started
        self.latency_s = _ewma(self.latency_s, elapsed)
        self.pair_s = _ewma(self.pair_s, elapsed / pairs)
        return (None,)

    @property
    def timeout_s(self) -> float:
        """The longest a call is given (`--backend-timeout-s`)."""
        return self._timeout_s

    def leash_s(self) -> float:
        """How long after it was sent an abandoned call may still run."""
        if self.latency_s is None:
            return min(ABANDON_UNKNOWN_S, self._timeout_s)
        return min(max(ABANDON_LATENCIES * self.latency_s, ABANDON_MIN_S), self._timeout_s)

    def _abandon(self, call: asyncio.Future[Any]) -> None:
        loop = asyncio.get_running_loop()
        attributes = self.instance.attributes
        self._metrics.abandoned_calls.add(1, attributes)
        self._metrics.abandoned_open.add(1, attributes)
        self.abandoned += 1
        abandoned_at = loop.time()
        sent_at = self._calls.get(call, abandoned_at)
        delay = max(0.0, sent_at + self.leash_s() - abandoned_at)

        def give_up() -> None:
            # Only while the call is on the wire: a task that made its call itself may
            # be past it (and `_forget` would never drop it from `_given_up`). Reported
            # now, not cancelled: the backend may be working on it (module docstring).
            if not call.done() and call in self._calls:
                self._given_up.add(call)
                self.on_outcome(
                    BackendCallError(
                        Failure.TIMEOUT,
                        f"abandoned call got no answer within {loop.time() - sent_at:.1f} s",
                    )
                )

        handle = loop.call_later(delay, give_up)

        def ended(task: asyncio.Future[Any]) -> None:
            handle.cancel()
            self.abandoned -= 1
            self._metrics.abandoned_open.add(-1, attributes)
            self._metrics.abandoned_age.record(loop.time() - abandoned_at, attributes)
            _consume(task)

        call.add_done_callback(ended)

    async def get_json(self, path: str) -> Any:
        """GET `path` on the side client (metadata, not work); None on any failure."""
        try:
            status, body = await self._side_get(path, SIDE_MAX_BYTES)
            return json.loads(body) if status == 200 else None
        except (
            httpx.HTTPError,
            TimeoutError,
            json.JSONDecodeError,
            UnicodeDecodeError,
            RecursionError,
        ):
            return None

    async def health(self) -> bool:
        """Whether the health path answers 200 (llama-server's `/health`: model loaded);
        always True when there is no health path to poll. On the side client."""
        if not self.health_path:
            return True
        try:
            status, _ = await self._side_get(self.health_path, HEALTH_MAX_BYTES)
        except (httpx.HTTPError, TimeoutError):
            return False
        return status == 200

    async def _side_get(self, path: str, max_bytes: int) -> tuple[int, bytes]:
        """Status and body (at most `max_bytes` of it, sent and decoded) of a GET on the
        side client, all within HEALTH_TIMEOUT_S. httpx's timeouts bound each read, not
        the whole: a `/health` sent a byte a second held the monitor's poll, and so
        every instance's health, for good; and its decoding has no bound.

        At most SIDE_CONNECTIONS at once, waiting here rather than in httpcore's pool: a
        request cancelled (by the timeout) while it waited there for a connection could
        leave that connection counted as in use for good (encode/httpcore#1093). Health
        polls, `/props` and `/v1/models` overlapping against a backend that stopped
        answering leaked both, and once it answered again every health poll still
        failed, so the instance stayed down until the process restarted."""
        async with (
            asyncio.timeout(HEALTH_TIMEOUT_S),
            self._side_slots,
            self._side_client.stream(
                "GET", self.base_url + path, headers=self._headers
            ) as response,
        ):
            return await _read_bounded(response, max_bytes)

    def record_malformed(self) -> None:
        """Count a call whose JSON parsed but did not hold what the scorer needs."""
        self._metrics.backend_errors.add(
            1, {**self.instance.attributes, ERROR_TYPE: ERROR_TYPES[Failure.MALFORMED]}
        )

    async def _send_measured(self, path: str, payload: Any, pairs: int, decode: Decode) -> Any:
        """One call timed into `http.client.request.duration`, with a client span under
        `--trace-backend-calls`, and the trace context sent along."""
        attributes = self.instance.attributes
        started = time.perf_counter()
        status: int | None = None
        error_type: str | None = None
        # Not made current: nothing below starts spans, and attaching costs per call.
        span = (
            self._tracer.start_span(
                "POST",
                kind=trace.SpanKind.CLIENT,
                attributes={
                    **attributes,
                    HTTP_METHOD: "POST",
                    "url.path": path,
                    "rerank.pairs": pairs,
                },
            )
            if self._trace_calls
            else None
        )
        # The backend continues the trace: from this call's span, or from the request's
        # (sampled ones only: `continuing` stores none for the others, and nothing is
        # stored while tracing is off).
        if span is None:
            propagated = trace_context.current()
        else:
            propagated = trace_context.headers_for(span) if span.is_recording() else None
        try:
            body, status = await self._send_single_request(path, payload, propagated, decode)
            return body
        except BackendCallError as exc:
            error_type = ERROR_TYPES[exc.failure]
            status = exc.status or None
            self._metrics.backend_errors.add(1, {**attributes, ERROR_TYPE: error_type})
            if span is not None:
                span.set_status(trace.StatusCode.ERROR, exc.detail)
            raise
        finally:
            if span is not None:
                if status is not None:
                    span.set_attribute(HTTP_STATUS, status)
                if error_type is not None:
                    span.set_attribute(ERROR_TYPE, error_type)
                span.end()
            self._metrics.call_durations.record(
                time.perf_counter() - started, self.instance, status, error_type
            )

    async def _send_single_request(
        self,
        path: str,
        payload: Any,
        propagated: trace_context.TraceHeaders | None,
        decode: Decode = orjson.loads,
    ) -> tuple[Any, int]:
        """The request itself, as bytes on the lean transport or through httpx's; a
        refusal or a failure classified (`BackendCallError`), the answer decoded."""
        content = orjson.dumps(payload)
        try:
            if self._lean is not None:
                # The head is bytes kept per path; only the length and the trace vary.
                data = b"%scontent-length: %d\r\n%s\r\n%s" % (
                    self._head(path),
                    len(content),
                    propagated[1] if propagated else b"",
                    content,
                )
                answer = await self._lean.send(
                    *self._address, data, self._timeout_s, self._timeout_s
                )
                status, body = answer.status, answer.content()
            else:
                assert self._client is not None
                headers = {
                    **self._headers,
                    "content-type": "application/json",
                    **(propagated[0] if propagated else {}),
                }
                status, body = await self._send_via_httpx(path, content, headers)
        except httpx.TimeoutException as exc:
            raise BackendCallError(Failure.TIMEOUT, type(exc).__name__) from None
        except httpx.TransportError as exc:
            raise BackendCallError(Failure.UNAVAILABLE, type(exc).__name__) from None
        except httpx.DecodingError as exc:  # an encoding we cannot or will not undo
            raise BackendCallError(
                Failure.MALFORMED, f"undecodable body: {exc}", status=0
            ) from None
        if not 200 <= status < 300:
            # llama-server refuses an embedding input longer than its physical batch with
            # a 500 ("input ... is too large to process"): the input's fault all the same,
            # not to be retried elsewhere or counted against the instance.
            # A 413 (a proxy's or the server's body limit) is the input's size too.
            if status == 413 or (400 <= status < 600 and refused_as_too_long(body)):
                raise BackendCallError(
                    Failure.HTTP_ERROR,
                    f"HTTP {status}: the document exceeds the model's context",
                    status,
                    too_long=True,
                    limit_tokens=physical_batch(body),
                )
            # A redirect or an odd status is no answer either, whatever its body.
            raise BackendCallError(Failure.HTTP_ERROR, f"HTTP {status}", status)
        try:
            return decode(body), status
        except MalformedResponse:
            raise  # JSON of the wrong shape: the scorer's decoder says what is missing
        except (orjson.JSONDecodeError, msgspec.DecodeError, RecursionError):
            # msgspec raises RecursionError for deeply nested input, where orjson
            # reports it as a decoding error.
            raise BackendCallError(Failure.MALFORMED, "response is not JSON", status) from None

    async def _send_via_httpx(
        self, path: str, content: bytes, headers: dict[str, str]
    ) -> tuple[int, bytes]:
        """A POST on httpx's own transport (https, proxies), its answer read raw and
        decoded here, both with the lean transport's bound."""
        assert self._client is not None
        async with self._client.stream(
            "POST", self._url(path), content=content, headers=headers
        ) as response:
            return await _read_bounded(response, lean.MAX_BODY_BYTES)

    def _url(self, path: str) -> httpx.URL:
        url = self._urls.get(path)
        if url is None:  # parsed once per path: httpx parses a string on every call
            url = self._urls[path] = httpx.URL(self.base_url + path)
        return url

    def _head(self, path: str) -> bytes:
        """The request head for `path` up to the length: request line, Host, our headers
        and the JSON type, as httpx would send them; built once per path."""
        head = self._heads.get(path)
        if head is None:
            request = httpx.Request(
                "POST",
                self._url(path),
                headers={**self._headers, "content-type": "application/json"},
            )
            head = self._heads[path] = lean.request_head(request, omit=b"content-length")
        return head

    async def aclose(self) -> None:
        """Cancel the calls still running (nobody waits for them any more), then close."""
        for call in list(self._calls):
            call.cancel()
        if self._calls:
            await asyncio.wait(list(self._calls))
        if self._lean is not None:
            await self._lean.aclose()
        if self._client is not None:
            await self._client.aclose()
        await self._side_client.aclose()
        self._metrics.watch_active(self, None)


def _ewma(previous: float | None, sample: float, weight: float = 0.2) -> float:
    return sample if previous is None else (1 - weight) * previous + weight * sample


def _consume(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()
