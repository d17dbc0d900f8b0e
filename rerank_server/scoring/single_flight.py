"""Identical pairs in flight are scored once: a request whose pair is being scored for
another request waits for that score instead of sending the pair again."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from .base import Emit, PairOutcome, Scorer, ScoreRequest
from .calls import CallTasks

# What a score depends on, as the score cache keys it (for one model): the prompt's
# variant, query, instruction, token cap, and the document's text.
FlightKey = tuple[str, str, str, int, str]


class SingleFlight:
    """`inner`, with each pair sent at most once while it is in flight in this process.

    Retries and overlapping requests (pagination, agents asking again, a burst of one
    query from several users) arrive while the first is still scoring, before the score
    cache has the answer. A pair whose flight ended without a score (the other request's
    budget ran out, its call failed, it was cancelled) is sent by the request that waited,
    within its own budget.
    """

    def __init__(self, inner: Scorer) -> None:
        self.inner = inner
        self._flights: dict[FlightKey, _Flight] = {}

    @property
    def kind(self) -> str:
        return self.inner.kind

    @property
    def model(self) -> str:
        return self.inner.model

    @property
    def variant(self) -> str:
        return self.inner.variant

    @property
    def calls(self) -> CallTasks:
        return self.inner.calls

    def estimate_s(self, pairs: int, outstanding: int = 0) -> float:
        return self.inner.estimate_s(pairs, outstanding)

    async def discover_model(self) -> None:
        await self.inner.discover_model()

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def score(self, request: ScoreRequest, emit: Emit) -> None:
        # Not the model's name: one SingleFlight wraps one model's scorer, and the name
        # becomes known from the first answers, while the first pairs are in flight.
        shared = (
            self.inner.variant,
            request.query,
            request.instruction,
            request.max_tokens_per_doc,
        )
        flights = self._flights
        own: list[tuple[FlightKey, _Flight]] = []
        positions: list[int] = []  # of the own pairs in the request
        waiting: dict[int, _Flight] = {}
        for i, document in enumerate(request.documents):
            key = (*shared, document)
            flight = flights.get(key)
            if flight is None:
                flights[key] = flight = _Flight()
                own.append((key, flight))
                positions.append(i)
            else:
                waiting[i] = flight
        reporting = True
        unscored: list[int] = []

        def report(outcome: PairOutcome) -> None:
            if reporting:  # nothing reaches a request that has stopped listening
                emit(outcome)

        def own_outcome(outcome: PairOutcome) -> None:
            own[outcome.pair][1].land(outcome.score)
            if waiting:  # the pairs sent are a part of the request's: placed back
                outcome = outcome._replace(pair=positions[outcome.pair])
            report(outcome)

        pending = [
            future
            for i, flight in waiting.items()
            if (future := flight.waited(i, report, unscored)) is not None
        ]
        try:
            if own:
                sent = _subset(request, positions) if waiting else request
                await self.inner.score(sent, own_outcome)
                for _, flight in own:  # a pair the scorer left unreported lands unscored
                    flight.land(None)  # now: this request may be waiting on it too
            if pending:
                await asyncio.wait(pending)
            if unscored:
                resend = sorted(unscored)
                await self.inner.score(
                    _subset(request, resend),
                    lambda o: report(o._replace(pair=resend[o.pair])),
                )
        finally:
            # A landed flight stays until its request is done with scoring: a request
            # arriving meanwhile takes its score at once, before the score cache has it.
            reporting = False
            for key, flight in own:
                flight.land(None)  # not reported: its waiters send it themselves
                if flights.get(key) is flight:
                    del flights[key]


class _Flight:
    """A pair being scored for one request: its score once landed, and the futures of
    the requests waiting for it (made only when one waits: most pairs have none)."""

    __slots__ = ("landed", "score", "waiters")

    def __init__(self) -> None:
        self.landed = False
        self.score: float | None = None
        self.waiters: list[asyncio.Future[None]] | None = None

    def land(self, score: float | None) -> None:
        """The pair's outcome, once: `score`, or None when it got none."""
        if self.landed:
            return
        self.landed, self.score = True, score
        for waiter in self.waiters or ():
            if not waiter.done():
                waiter.set_result(None)

    def waited(
        self, i: int, report: Callable[[PairOutcome], None], unscored: list[int]
    ) -> asyncio.Future[None] | None:
        """Request position `i` waits for this pair: reported when it lands with a
        score, else put in `unscored`; the future to wait on (None: landed already)."""

        def settle(_: object = None) -> None:
            if self.score is None:
                unscored.append(i)
            else:
                report(PairOutcome(i, self.score))

        if self.landed:
            settle()
            return None
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiter.add_done_callback(settle)
        if self.waiters is None:
            self.waiters = []
        self.waiters.append(waiter)
        return waiter


def _subset(request: ScoreRequest, positions: Sequence[int]) -> ScoreRequest:
    return ScoreRequest(
        request.query,
        request.instruction,
        [request.documents[i] for i in positions],
        request.max_tokens_per_doc,
    )
