"""`score_within`: outcomes in groups as they land, and the ways waiting ends (budget,
shutdown), on uvloop as the server runs."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import uvloop
from opentelemetry.trace import NoOpTracer

from rerank_server.scoring import budget
from rerank_server.scoring.base import Emit, Failure, PairOutcome, ScoreRequest
from tests.fakes.scorer import FunctionScorer

REQUEST = ScoreRequest("q", "i", [f"doc {i}" for i in range(5)])


class Silent(FunctionScorer):
    """A backend that never answers."""

    async def score(self, request: ScoreRequest, emit: Emit) -> None:
        await asyncio.sleep(3600)


async def _groups(
    scorer: Any, budget_s: float, stop: budget.StopSignal | None = None
) -> list[list[PairOutcome]]:
    return [
        group async for group in budget.score_within(scorer, REQUEST, budget_s, NoOpTracer(), stop)
    ]


def _on_uvloop(main: Callable[[], Awaitable[Any]]) -> Any:
    return uvloop.run(main())


def test_a_batch_that_lands_whole_arrives_as_one_group() -> None:
    groups = _on_uvloop(lambda: _groups(FunctionScorer(), 5.0))
    assert [[o.pair for o in g] for g in groups] == [[0, 1, 2, 3, 4]]
    assert all(o.failure is None for o in groups[0])


def test_running_out_of_budget_wakes_the_request_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """uvloop rounds timers to the millisecond, so the budget's timer may fire a little
    early; the request must time out then, not wait again in zero-length timers."""
    waits = 0
    original = budget._Inbox.wait

    async def counted(self: budget._Inbox) -> None:
        nonlocal waits
        waits += 1
        await original(self)

    monkeypatch.setattr(budget._Inbox, "wait", counted)
    groups = _on_uvloop(lambda: _groups(Silent(), 0.0104))
    outcomes = [o for g in groups for o in g]
    assert sorted(o.pair for o in outcomes) == list(range(5))
    assert {o.failure for o in outcomes} == {Failure.TIMEOUT}
    assert waits == 1


def test_shutdown_wakes_a_waiting_request() -> None:
    async def main() -> tuple[list[list[PairOutcome]], float]:
        stop = budget.StopSignal()
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, stop.set)
        started = loop.time()
        groups = await _groups(Silent(), 60.0, stop)
        return groups, loop.time() - started

    groups, elapsed = _on_uvloop(main)
    assert {o.failure for g in groups for o in g} == {Failure.SHUTTING_DOWN}
    assert elapsed < 5.0


def test_a_score_off_0_to_1_fails_its_pair_alone() -> None:
    """Whatever a scorer's decoder lets through, the blend sees scores on 0..1: a NaN
    (which fails every comparison and would sort anywhere), a raw logit, or no score
    without a failure fail their own pairs as malformed; the others stand."""
    scores = {"doc 0": float("nan"), "doc 1": 1.5, "doc 2": 0.25, "doc 3": -0.1, "doc 4": 1.0}
    groups = _on_uvloop(lambda: _groups(FunctionScorer(score_of=scores.__getitem__), 5.0))
    outcomes = {o.pair: o for g in groups for o in g}
    assert sorted(outcomes) == list(range(5))
    assert {i for i, o in outcomes.items() if o.failure is Failure.MALFORMED} == {0, 1, 3}
    assert (outcomes[2].score, outcomes[4].score) == (0.25, 1.0)
