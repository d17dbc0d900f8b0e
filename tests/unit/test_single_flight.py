"""The single flight over an in-process scorer: what a scorer leaves unreported never
holds a request (the wire's side: tests/service/test_single_flight.py)."""

from __future__ import annotations

import asyncio

from rerank_server.scoring.base import PairOutcome, ScoreRequest
from rerank_server.scoring.single_flight import SingleFlight
from tests.fakes.scorer import FunctionScorer


async def test_a_pair_left_unreported_twice_in_one_request_does_not_hang_it() -> None:
    """The request's second "bad" waits on its own first one, which the scorer never
    reports: it lands unscored when the call ends, and is sent once more."""
    scorer = FunctionScorer(score_of=lambda _: 0.5, omits=lambda d: d == "bad")
    outcomes: list[PairOutcome] = []
    request = ScoreRequest("q", "", ["bad", "ok", "bad"], 0)
    await asyncio.wait_for(SingleFlight(scorer).score(request, outcomes.append), 2)
    assert outcomes == [PairOutcome(1, 0.5)]
    assert scorer.seen == ["bad", "ok", "bad"]
