"""Scoring within a time budget: every pair's outcome exactly once, never past the budget."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import structlog
from opentelemetry import trace

from .base import Emit, Failure, PairOutcome, Scorer, ScoreRequest
from .calls import CallTasks
from .transport import trace_context
from .transport.wakeup import Wakeup

log = structlog.get_logger(__name__)

# Of the caller's remaining deadline, a reserve is kept back for blending and sending the
# answer: 10% of it, at most 50 ms on an idle loop. Under load it grows: at least a few
# times the event loop's recent lag (a late loop sends late), and a little per request in
# progress (requests that started together time out together, and each answer costs CPU
# to build and send). Never more than half the deadline.
DEADLINE_RESERVE_FRACTION = 0.1
DEADLINE_RESERVE_MAX_S = 0.05
LAG_RESERVE_FACTOR = 3.0
PER_REQUEST_RESERVE_S = 0.003


def reserve_s(
    deadline_remaining_s: float,
    loop_lag_s: float = 0.0,
    active: int = 0,
) -> float:
    idle = min(DEADLINE_RESERVE_MAX_S, deadline_remaining_s * DEADLINE_RESERVE_FRACTION)
    busy = max(LAG_RESERVE_FACTOR * loop_lag_s, PER_REQUEST_RESERVE_S * active)
    return min(max(idle, busy), deadline_remaining_s / 2)


def budget_s(
    timeout_s: float, deadline_remaining_s: float | None, loop_lag_s: float = 0.0, active: int = 0
) -> float:
    """Seconds the scorer may use: the request's timeout, shortened by the caller's deadline
    less the reserve for blending and sending."""
    budget = timeout_s
    if deadline_remaining_s is not None:
        budget = min(
            budget, deadline_remaining_s - reserve_s(deadline_remaining_s, loop_lag_s, active)
        )
    return max(budget, 0.0)


class StopSignal:
    """Set once, when the server starts shutting down; wakes every request waiting for
    scores (an `asyncio.Event` would need a task per waiter to be watched)."""

    def __init__(self) -> None:
        self._set = False
        self._listeners: set[Callable[[], None]] = set()

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        self._set = True
        for listener in list(self._listeners):
            listener()

    def subscribe(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call `listener` when set; returns the unsubscribe."""
        self._listeners.add(listener)
        return lambda: self._listeners.discard(listener)


class _Inbox(Wakeup):
    """The outcomes a scorer has reported and not yet taken; one waiter at a time, woken
    by each outcome, the scorer's end and the stop signal, expired by the budget's one
    timer."""

    def __init__(self) -> None:
        super().__init__()
        self.items: list[PairOutcome] = []

    def put(self, outcome: PairOutcome) -> None:
        """The scorer's `emit` (`wake` inline: a batch emits a pair at a time)."""
        self.items.append(outcome)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def take(self) -> list[PairOutcome]:
        items, self.items = self.items, []
        return items


async def score_within(
    scorer: Scorer,
    request: ScoreRequest,
    budget: float,
    tracer: trace.Tracer,
    stop: StopSignal | None = None,
    span: trace.Span | None = None,
    model: str = "",
) -> AsyncIterator[list[PairOutcome]]:
    """The pairs' outcomes as they arrive, each exactly once; those left when `budget`
    runs out as timeouts, and those left when `stop` is set (the server is shutting
    down) as such.

    Traced in a `rerank.score` span of its own, or, given `span` (the request's own span,
    current here), in that one: its attributes go there and the backend calls continue
    it, one span fewer per request. `model`: the served model's name for the span
    (default: what the scorer calls its model).

    A scorer that returns without reporting every pair fails the rest as malformed, one
    that crashes as a backend error: backend trouble never raises here.

    The budget bounds only the waits, never the caller's work between yields: a timeout
    that fired while the caller wrote a stream message would cancel the RPC.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + budget
    inbox = _Inbox()
    remaining = set(range(len(request.documents)))
    attributes: dict[str, str | int] = {
        "rerank.backend": scorer.kind,
        "rerank.pairs": len(remaining),
    }
    own = span is None
    if span is None:
        # Not a `with` block: the span must not stay current across the yields below.
        # The scorer task copies the context at creation, so backend calls become its
        # children.
        span = tracer.start_span("rerank.score", attributes=attributes)
        attributes = {}
    if span is trace.INVALID_SPAN:  # tracing off: no context to switch for the task
        task = asyncio.create_task(_scoring(scorer, request, inbox.put))
    elif own:
        with trace.use_span(span, end_on_exit=False), trace_context.continuing(span):
            task = asyncio.create_task(_scoring(scorer, request, inbox.put))
    else:  # already current
        with trace_context.continuing(span):
            task = asyncio.create_task(_scoring(scorer, request, inbox.put))
    task.add_done_callback(inbox.wake)
    # One timer for the whole budget, not one per wait (a per-pair backend waits once per
    # arriving group); it only marks the inbox, so it never interrupts the caller.
    timer = loop.call_at(deadline, inbox.expire)
    unsubscribe = stop.subscribe(inbox.wake) if stop is not None else None
    scored = failed = 0
    rest: tuple[Failure, str] | None = None
    try:
        while remaining:
            arrived = inbox.take()
            if not arrived:
                rest = _why_nothing(
                    task, stop, inbox.expired or loop.time() >= deadline, scorer.kind
                )
                if rest is not None:
                    break
                await inbox.wait()
                continue
            fresh = []
            for outcome in arrived:
                if outcome.pair not in remaining:
                    continue  # a scorer's second report of a pair is ignored
                remaining.discard(outcome.pair)
                if outcome.failure is None:
                    # The contract is a score on 0..1. Held here for every scorer, so a
                    # NaN (which fails every comparison) never reaches the blend and
                    # the sort, whatever a decoder lets through.
                    score = outcome.score
                    if score is not None and 0.0 <= score <= 1.0:
                        scored += 1
                        fresh.append(outcome)
                        continue
                    outcome = PairOutcome.failed(
                        outcome.pair, Failure.MALFORMED, "no score on 0..1"
                    )
                failed += 1
                fresh.append(outcome)
            if fresh:
                yield fresh
        if rest is not None:
            await _stop(task, scorer.calls)
            failure, detail = rest
            failed += len(remaining)
            left = [PairOutcome.failed(pair, failure, detail) for pair in sorted(remaining)]
            remaining.clear()
            yield left
    finally:
        timer.cancel()
        if unsubscribe is not None:
            unsubscribe()
        await _stop(task, scorer.calls)
        if span.is_recording():  # the request's span gets all of them here, at once
            span.set_attributes(
                {
                    **attributes,
                    "rerank.model": model or scorer.model,
                    "rerank.scored": scored,
                    "rerank.failed": failed,
                }
            )
        if own:
            span.end()


def _why_nothing(
    task: asyncio.Task[None], stop: StopSignal | None, spent: bool, backend: str
) -> tuple[Failure, str] | None:
    """Why no more outcomes will come, when nothing is waiting to be taken; None while
    they still may."""
    if stop is not None and stop.is_set():
        return Failure.SHUTTING_DOWN, "the server is shutting down"
    if task.done():
        if not task.cancelled() and task.exception() is not None:
            detail = type(task.exception()).__name__
            log.error("scorer_crashed", backend=backend, error=detail)
            return Failure.HTTP_ERROR, f"scorer crashed: {detail}"
        return Failure.MALFORMED, "the scorer reported no outcome for this pair"
    if spent:
        return Failure.TIMEOUT, "time budget spent"
    return None


async def _scoring(scorer: Scorer, request: ScoreRequest, emit: Emit) -> None:
    """The scorer's task. It makes its backend calls itself (`Scorer.calls`): a batching
    scorer's one call per request needs no task and shield of its own (a tenth of a
    batched call's CPU); `_stop` lets it go rather than cancel it, so a call on the wire
    is abandoned on the leash, as a shielded one would be."""
    me = asyncio.current_task()
    assert me is not None
    scorer.calls.own(me)
    try:
        await scorer.score(request, emit)
    finally:
        scorer.calls.done(me)


async def _stop(task: asyncio.Task[None], calls: CallTasks) -> None:
    """Stop waiting for the scorer: let it go (`CallTasks.let_go`), and wait for it to unwind
    when that cancelled it (a per-pair scorer then lets its pairs go); an abandoned call
    runs on within its leash without anyone waiting for it."""
    if not task.done():
        calls.let_go(task)
        if task.cancelling():
            await asyncio.gather(task, return_exceptions=True)
