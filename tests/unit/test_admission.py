"""Admission against the backend's queue: the estimate counts whole rounds of calls, and a
request is admitted only with headroom left in its budget (docs/reliability.md)."""

from __future__ import annotations

import asyncio

import pytest

from rerank_server.domain import (
    Candidate,
    DegradedCode,
    RankedCandidate,
    RerankQuery,
    RerankSummary,
)
from rerank_server.ranking.pipeline import ADMISSION_HEADROOM, Reranker
from rerank_server.scoring.backend_pool import BackendPool
from rerank_server.server import request_rules
from rerank_server.settings import Settings
from tests.fakes.scorer import FunctionScorer


def test_the_estimate_counts_whole_rounds_of_the_slots() -> None:
    pool = BackendPool(["http://127.0.0.1:1"], concurrency=4, timeout_s=1, kind="chat")
    http = pool.endpoints[0].http
    assert pool.estimate_s(10) == 0.0  # no latency sample yet: nothing to go on
    http.pair_s = 0.2
    # 10 pairs, one call each, 4 at a time: three rounds of calls, not two and a half.
    assert pool.estimate_s(10) == pytest.approx(0.6)
    assert pool.estimate_s(8) == pytest.approx(0.4)
    http.queued_pairs, http.in_flight_pairs = 5, 4  # behind 9 others: 19 pairs, 5 rounds
    assert pool.estimate_s(10) == pytest.approx(1.0)


def answer(queued_s: float) -> tuple[list[RankedCandidate], RerankSummary, FunctionScorer]:
    scorer = FunctionScorer(queued_s=queued_s)
    reranker = Reranker(request_rules(Settings(min_candidates=2)), scorer)
    query = RerankQuery(request_id="r", query="q", timeout_s=1.0, candidates=tuple(
        Candidate(id=f"d{i}", text=f"doc {i}", index=i, retrieval_rank=i + 1)
        for i in range(5)))
    results, summary = asyncio.run(reranker.answer(query))
    return results, summary, scorer


def test_a_queue_within_the_budget_less_headroom_is_admitted() -> None:
    _, summary, scorer = answer(queued_s=(1 - ADMISSION_HEADROOM) * 0.99)
    assert summary.reranked and summary.degraded is None
    assert len(scorer.seen) == 5


def test_a_queue_in_the_headroom_is_answered_overloaded_at_once() -> None:
    # Within the budget, but with less slack than the estimate's error can eat.
    results, summary, scorer = answer(queued_s=(1 - ADMISSION_HEADROOM) * 1.01)
    assert not summary.reranked
    assert summary.degraded is not None and summary.degraded.code is DegradedCode.OVERLOADED
    assert scorer.seen == []  # nothing was sent
    assert [r.candidate.id for r in results] == [f"d{i}" for i in range(5)]  # retrieval order
