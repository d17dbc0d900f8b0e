"""Identical pairs in flight are scored once: a request whose pair is being scored for
another request waits for that score instead of sending the pair again."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence

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
        self._flights: dict[FlightKey, asyncio.Future[float | None]] = {}

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
        loop = asyncio.get_running_loop()
        # Not the model's name: one SingleFlight wraps one model's scorer, and the name
        # becomes known from the first answers, while the first pairs are in flight.
        shared = (
            self.inner.variant,
            request.query,
            request.instruction,
            request.max_tokens_per_doc,
        )
        own: list[tuple[int, FlightKey, asyncio.Future[float | None]]] = []
        waiting: dict[int, asyncio.Future[float | None]] = {}
        for i, document in enumerate(request.documents):
            key = (*shared, document)
            flight = self._flights.get(key)
            if flight is None:
                flight = self._flights[key] = loop.create_future()
                own.append((i, key, flight))
            else:
                waiting[i] = flight
        reporting = True
        unscored: list[int] = []

        def report(outcome: PairOutcome) -> None:
            if reporting:  # nothing reaches a request that has stopped listening
                emit(outcome)

        def landed(i: int, flight: asyncio.Future[float | None]) -> None:
            score = None if flight.cancelled() else flight.result()
            if score is None:
                unscored.append(i)
            else:
                report(PairOutcome(i, score))

        def own_outcome(outcome: PairOutcome) -> None:
            i, _, flight = own[outcome.pair]
            report(outcome._replace(pair=i))
            if not flight.done():
                flight.set_result(outcome.score)

        for i, flight in waiting.items():
            flight.add_done_callback(functools.partial(landed, i))
        try:
            if own:
                await self.inner.score(_subset(request, [i for i, _, _ in own]), own_outcome)
            if waiting:
                await asyncio.wait(set(waiting.values()))
            if unscored:
                positions = sorted(unscored)
                await self.inner.score(
                    _subset(request, positions),
                    lambda o: report(o._replace(pair=positions[o.pair])),
                )
        finally:
            # A landed flight stays until its request is done with scoring: a request
            # arriving meanwhile takes its score at once, before the score cache has it.
            reporting = False
            for _, key, flight in own:
                if not flight.done():  # not reported: its waiters send it themselves
                    flight.set_result(None)
                if self._flights.get(key) is flight:
                    del self._flights[key]


def _subset(request: ScoreRequest, positions: Sequence[int]) -> ScoreRequest:
    return ScoreRequest(
        request.query,
        request.instruction,
        [request.documents[i] for i in positions],
        request.max_tokens_per_doc,
    )
