"""Scoring within a time budget: every pair's outcome exactly once, never past the budget.

`score_within` runs a scorer and yields each pair's `PairOutcome` as it arrives. Pairs the
scorer has not reported when the budget runs out come back failed as timeouts; a scorer
that returns without reporting every pair, or crashes, fails the rest as malformed or as a
backend error. So the caller always gets one outcome per pair and never an exception for
backend trouble.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import structlog
from opentelemetry import trace

from .base import Failure, PairOutcome, Scorer, ScoreRequest

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


def reserve_s(deadline_remaining_s: float, loop_lag_s: float = 0.0, active: int = 0,
              ) -> float:
    idle = min(DEADLINE_RESERVE_MAX_S, deadline_remaining_s * DEADLINE_RESERVE_FRACTION)
    busy = max(LAG_RESERVE_FACTOR * loop_lag_s, PER_REQUEST_RESERVE_S * active)
    return min(max(idle, busy), deadline_remaining_s / 2)


def budget_s(timeout_s: float, deadline_remaining_s: float | None,
             loop_lag_s: float = 0.0, active: int = 0) -> float:
    """Seconds the scorer may use: the request's timeout, shortened by the caller's deadline
    less the reserve for blending and sending."""
    budget = timeout_s
    if deadline_remaining_s is not None:
        budget = min(budget, deadline_remaining_s - reserve_s(deadline_remaining_s,
                                                              loop_lag_s, active))
    return max(budget, 0.0)


async def score_within(scorer: Scorer, request: ScoreRequest, budget: float,
                       tracer: trace.Tracer, stop: asyncio.Event | None = None,
                       ) -> AsyncIterator[PairOutcome]:
    """Each pair's outcome, as it arrives; those left when `budget` runs out as timeouts,
    and those left when `stop` is set (the server is shutting down) as such.

    The budget bounds only the waits, never the caller's work between yields: a timeout
    that fired while the caller wrote a stream message would cancel the RPC.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + budget
    outcomes: asyncio.Queue[PairOutcome] = asyncio.Queue()
    remaining = set(range(len(request.documents)))
    # Not a `with` block: the span must not stay current across the yields below. The
    # scorer task copies the context at creation, so backend calls become its children.
    span = tracer.start_span("rerank.score", attributes={
        "rerank.backend": scorer.kind, "rerank.pairs": len(remaining)})
    with trace.use_span(span, end_on_exit=False):
        task = asyncio.create_task(scorer.score(request, outcomes.put_nowait))
    scored = failed = 0
    rest: tuple[Failure, str] | None = None
    try:
        while remaining:
            try:
                # Outcomes already in (a batch lands all at once) are taken as they are:
                # a wait_for per pair costs a task and a timer, and waits for nothing.
                outcome = outcomes.get_nowait() if not outcomes.empty() else \
                    await asyncio.wait_for(_next_outcome(outcomes, task, stop),
                                           max(deadline - loop.time(), 0))
            except TimeoutError:
                rest = (Failure.TIMEOUT, "time budget spent")
                break
            except _Stopped:
                rest = (Failure.SHUTTING_DOWN, "the server is shutting down")
                break
            except _ScorerCrashed as crash:
                log.error("scorer_crashed", backend=scorer.kind, error=crash.detail)
                rest = (Failure.HTTP_ERROR, f"scorer crashed: {crash.detail}")
                break
            if outcome is None:
                rest = (Failure.MALFORMED, "the scorer reported no outcome for this pair")
                break
            if outcome.pair not in remaining:
                continue  # a scorer's second report of a pair is ignored
            remaining.discard(outcome.pair)
            if outcome.failure is None:
                scored += 1
            else:
                failed += 1
            yield outcome
        if rest is not None:
            await _stop(task)
            failure, detail = rest
            for pair in sorted(remaining):
                failed += 1
                yield PairOutcome.failed(pair, failure, detail)
            remaining.clear()
    finally:
        await _stop(task)
        span.set_attributes({"rerank.model": scorer.model, "rerank.scored": scored,
                             "rerank.failed": failed})
        span.end()


async def _stop(task: asyncio.Task[None]) -> None:
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


class _Stopped(Exception):
    pass


class _ScorerCrashed(Exception):
    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


async def _next_outcome(outcomes: asyncio.Queue[PairOutcome], task: asyncio.Task[None],
                        stop: asyncio.Event | None) -> PairOutcome | None:
    """The next outcome; None once the scorer has finished and nothing is left."""
    if not outcomes.empty():
        return outcomes.get_nowait()
    if stop is not None and stop.is_set():
        raise _Stopped
    getter = asyncio.ensure_future(outcomes.get())
    waits: set[asyncio.Future[Any]] = {getter, task}
    stopped = asyncio.ensure_future(stop.wait()) if stop is not None else None
    if stopped is not None:
        waits.add(stopped)
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in (getter, stopped):
            if waiter is not None and not waiter.done():
                waiter.cancel()
    if getter.done() and not getter.cancelled():
        return getter.result()
    if stopped is not None and stopped.done() and not stopped.cancelled():
        raise _Stopped
    if task.done() and not task.cancelled() and task.exception() is not None:
        exc = task.exception()
        raise _ScorerCrashed(type(exc).__name__)
    return outcomes.get_nowait() if not outcomes.empty() else None
