"""A pool of backend instances: least-outstanding balancing and outlier ejection.

What it promises: docs/backends.md, "Several instances: the pool".
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
import structlog
from opentelemetry import trace

from ...observability.metrics import Metrics
from ..base import Failure
from ..calls import CallTasks
from .backend import HttpBackend
from .errors import BackendCallError, Decode, MalformedResponse

log = structlog.get_logger(__name__)

T = TypeVar("T")

# The instance a probe must use, even while it is ejected (`BackendPool.pinned`).
_PINNED: ContextVar[Endpoint | None] = ContextVar("rerank_pinned_endpoint", default=None)


@dataclass(frozen=True, slots=True)
class Ejection:
    """When an instance is taken out of the pool, and for how long (`--eject-*`)."""

    after: int = 3  # consecutive failures
    base_s: float = 1.0  # first back-off
    max_s: float = 4.0  # longest back-off


@dataclass
class Endpoint:
    """One backend instance and what the pool knows about it."""

    http: HttpBackend
    concurrency: int
    failures_in_row: int = 0
    ejections_in_row: int = 0
    ejected_until: float | None = None  # monotonic; set while ejected
    healthy: bool = True  # per the health monitor (optimistic until polled)
    ejections: int = 0
    answered_at: float | None = None  # monotonic time of the last successful call
    failed_polls: int = 0  # health polls failed in a row
    polls_failing_since: float | None = None

    @property
    def name(self) -> str:
        return f"{self.http.instance.address}:{self.http.instance.port}"

    @property
    def available(self) -> bool:
        return self.healthy and self.ejected_until is None


class BackendPool:
    """Calls a backend through whichever instance is best placed to answer."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        concurrency: int,
        timeout_s: float,
        kind: str,
        metrics: Metrics | None = None,
        tracer: trace.Tracer | None = None,
        ejection: Ejection | None = None,
        headers: dict[str, str] | None = None,
        health_path: str = "/health",
        clock: Callable[[], float] = time.monotonic,
        trace_calls: bool = False,
    ) -> None:
        if not urls:
            raise ValueError("a backend pool needs at least one URL")
        self.kind = kind
        self.calls = CallTasks()  # tasks making their own calls, to any instance
        self._metrics = metrics or Metrics.noop()
        self._ejection = ejection or Ejection()
        self._clock = clock
        self.endpoints = [
            Endpoint(
                HttpBackend(
                    url,
                    concurrency,
                    timeout_s,
                    kind=kind,
                    metrics=metrics,
                    tracer=tracer,
                    headers=headers,
                    health_path=health_path,
                    trace_calls=trace_calls,
                    calls=self.calls,
                ),
                concurrency,
            )
            for url in urls
        ]
        for endpoint in self.endpoints:
            endpoint.http.on_outcome = functools.partial(self._outcome, endpoint)
        self._turn = itertools.count()
        self.polls_to_down = 2
        # Set when an instance is ejected or restored, so the monitor can sleep until
        # something changes instead of looking a few times a second.
        self.changed = asyncio.Event()

    # --- calls

    async def call(
        self,
        path: str,
        payload: Any,
        parse: Callable[[Any], T],
        pairs: int = 1,
        decode: Decode = orjson.loads,
    ) -> T:
        """POST to the best instance and `parse` its JSON, as `decode` reads it (orjson
        unless a scorer gives its own, see `HttpBackend.post_json`); raises
        BackendCallError.

        `parse` (or `decode`) raises MalformedResponse for an answer it cannot use; that
        counts as a malformed response of that instance (not a reason to eject it).
        """
        tried: list[Endpoint] = []
        last: BackendCallError | None = None
        while True:
            endpoint = self._pick(tried)
            if endpoint is None:
                raise last or BackendCallError(Failure.UNAVAILABLE, "every backend instance is out")
            tried.append(endpoint)
            try:
                try:
                    body = await endpoint.http.post_json(path, payload, pairs, decode)
                except BackendCallError as exc:
                    last = exc
                    if _retryable(exc) and len(tried) < 2 and _PINNED.get() is None:
                        continue
                    raise
                return parse(body)
            except MalformedResponse as exc:
                endpoint.http.record_malformed()
                raise BackendCallError(Failure.MALFORMED, str(exc)) from None

    async def get_json(self, path: str) -> Any:
        """GET from an available instance (metadata such as /v1/models); None on failure."""
        endpoint = self._pick([])
        return None if endpoint is None else await endpoint.http.get_json(path)

    @contextlib.contextmanager
    def pinned(self, endpoint: Endpoint) -> Iterator[None]:
        """Calls made inside (and in tasks started inside) go to `endpoint` only, even while
        it is ejected: the monitor's probe of an ejected instance."""
        token = _PINNED.set(endpoint)
        try:
            yield
        finally:
            _PINNED.reset(token)

    def estimate_s(self, pairs: int, per_call: int = 1, outstanding: int = 0) -> float:
        """Seconds until `pairs` more pairs would be scored, `per_call` pairs to a call; 0
        with no latency sample yet. Behind the pairs queued and in flight, or behind
        `outstanding` if that is more (`Scorer.estimate_s`).

        The pairs queued and in flight drain over the available slots at the recent
        per-pair latency; then this request's own calls run, as many at once as there are
        slots, each taking its pairs' time. So 10 one-pair calls on 4 slots take three
        calls' time, not two and a half, and one call of 40 pairs takes its 40 pairs'
        time however many slots are free. Spreading a request's pairs evenly over the
        slots underestimated both: a batched request's own call by as many times as there
        are slots."""
        ready = [e for e in self.endpoints if e.available]
        rates = [e.http.pair_s for e in ready if e.http.pair_s is not None]
        if not ready or not rates:
            return 0.0
        rate = sum(rates) / len(rates)
        slots = sum(e.http.concurrency for e in ready)
        waiting = max(sum(e.http.queued_pairs + e.http.in_flight_pairs for e in ready), outstanding)
        calls = -(-pairs // per_call)
        rounds = -(-calls // slots)
        return waiting * rate / slots + rounds * min(pairs, per_call) * rate

    def _pick(self, exclude: list[Endpoint]) -> Endpoint | None:
        pinned = _PINNED.get()
        if pinned is not None:
            return None if pinned in exclude else pinned
        if len(self.endpoints) == 1:  # the common sidecar: nothing to balance
            only = self.endpoints[0]
            return only if only.available and not exclude else None
        ready = [e for e in self.endpoints if e.available and e not in exclude]
        if not ready:
            return None
        turn = next(self._turn)
        # Fewest in flight relative to the instance's own limit; rotate among equals.
        return min(
            ready,
            key=lambda e: (e.http.load, (self.endpoints.index(e) - turn) % len(self.endpoints)),
        )

    # --- ejection

    def _outcome(self, endpoint: Endpoint, failure: BackendCallError | None) -> None:
        """How one call to `endpoint` ended (`HttpBackend.on_outcome`), abandoned or not."""
        if failure is None:
            self._succeeded(endpoint)
        elif _counts_against(failure):
            self._failed(endpoint)

    def _failed(self, endpoint: Endpoint) -> None:
        endpoint.failures_in_row += 1
        if endpoint.ejected_until is not None:
            return
        if endpoint.failures_in_row >= self._ejection.after:
            self._eject(endpoint, f"{endpoint.failures_in_row} failed calls in a row")
        elif endpoint.http.stuck:
            self._eject(
                endpoint, f"all {endpoint.concurrency} slots held by calls that got no answer"
            )

    def _succeeded(self, endpoint: Endpoint) -> None:
        endpoint.answered_at = self._clock()
        endpoint.failures_in_row = 0
        endpoint.ejections_in_row = 0

    def _eject(self, endpoint: Endpoint, reason: str) -> None:
        backoff = min(self._ejection.base_s * 2**endpoint.ejections_in_row, self._ejection.max_s)
        endpoint.ejections_in_row += 1
        endpoint.ejections += 1
        endpoint.ejected_until = self._clock() + backoff
        self.changed.set()
        self._metrics.backend_ejections.add(1, endpoint.http.instance.attributes)
        log.warning(
            "backend_ejected",
            instance=endpoint.name,
            backend=self.kind,
            reason=reason,
            backoff_s=backoff,
        )

    def due_for_probe(self) -> list[Endpoint]:
        """Ejected instances whose back-off is over: the monitor probes them."""
        now = self._clock()
        return [e for e in self.endpoints if e.ejected_until is not None and now >= e.ejected_until]

    def next_probe_in(self, skip: Collection[str] = ()) -> float | None:
        """Seconds until the first back-off ends among ejected instances not named in
        `skip` (0 if one is over; None if none is ejected)."""
        now = self._clock()
        waits = [
            e.ejected_until - now
            for e in self.endpoints
            if e.ejected_until is not None and e.name not in skip
        ]
        return max(0.0, min(waits)) if waits else None

    def note_poll(self, endpoint: Endpoint, ok: bool) -> bool:
        """Record a health poll; whether the instance counts as up.

        A saturated llama-server can miss health polls while it computes (its HTTP
        thread starves on a busy CPU), so it is down only after `polls_to_down` failed
        polls in a row with no call answered since the first of them.
        """
        if ok:
            endpoint.failed_polls, endpoint.polls_failing_since = 0, None
            return True
        endpoint.failed_polls += 1
        if endpoint.polls_failing_since is None:
            endpoint.polls_failing_since = self._clock()
        answered = (
            endpoint.answered_at is not None
            and endpoint.answered_at >= endpoint.polls_failing_since
        )
        return endpoint.failed_polls < self.polls_to_down or answered

    def restore(self, endpoint: Endpoint) -> None:
        endpoint.ejected_until = None
        endpoint.failures_in_row = 0
        self.changed.set()
        log.info("backend_restored", instance=endpoint.name, backend=self.kind)

    def extend(self, endpoint: Endpoint) -> None:
        """The probe after a back-off failed: eject again, for longer."""
        self._eject(endpoint, "probe call after back-off got no answer")

    @property
    def any_available(self) -> bool:
        return any(e.available for e in self.endpoints)

    async def aclose(self) -> None:
        await asyncio.gather(*(e.http.aclose() for e in self.endpoints))


# A server error counts against its instance and is tried on another, unless it says the
# input is too long: that is the input's fault, on every instance.
def _counts_against(exc: BackendCallError) -> bool:
    return exc.failure in (Failure.UNAVAILABLE, Failure.TIMEOUT) or (
        exc.failure is Failure.HTTP_ERROR and exc.status >= 500 and not exc.too_long
    )


def _retryable(exc: BackendCallError) -> bool:
    return exc.failure is Failure.UNAVAILABLE or (
        exc.failure is Failure.HTTP_ERROR and exc.status >= 500 and not exc.too_long
    )
