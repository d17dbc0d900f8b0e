"""Admission against the backend's queue: the estimate counts whole rounds of calls, and a
request is admitted only with headroom left in its budget (docs/reliability.md)."""

from __future__ import annotations

import asyncio
import re

import pytest

from rerank_server.domain import (
    Candidate,
    DegradedCode,
    RankedCandidate,
    RerankQuery,
    RerankSummary,
)
from rerank_server.ranking.pair_admission import ADMISSION_HEADROOM
from rerank_server.ranking.pipeline import Reranker
from rerank_server.scoring.backends.chat import ChatScorer
from rerank_server.scoring.backends.rerank_api import RerankApiScorer
from rerank_server.scoring.transport.pool import BackendPool
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
    # Behind 9 others, which drain over the 4 slots first.
    http.queued_pairs, http.in_flight_pairs = 5, 4
    assert pool.estimate_s(10) == pytest.approx(9 * 0.2 / 4 + 0.6)


def test_a_batched_request_waits_for_its_own_call_whatever_the_free_slots() -> None:
    pool = BackendPool(["http://127.0.0.1:1"], concurrency=4, timeout_s=1, kind="rerank")
    pool.endpoints[0].http.pair_s = 0.05
    # One call of 40 pairs takes 40 pairs' time: the idle slots do not share it (spread
    # over 4 slots it was a quarter of that, and admission let in requests that then ran
    # out of time instead of being answered at once).
    assert pool.estimate_s(40, per_call=100) == pytest.approx(2.0)
    # Two calls (32 + 8 pairs) run side by side: the longer one's time.
    assert pool.estimate_s(40, per_call=32) == pytest.approx(1.6)
    # The scorer says how many pairs go to a call: its `--max-batch`, or one.
    assert RerankApiScorer(pool, max_batch=32).estimate_s(40) == pytest.approx(1.6)
    assert ChatScorer(pool).estimate_s(40) == pytest.approx(10 * 0.05)


def answer(queued_s: float) -> tuple[list[RankedCandidate], RerankSummary, FunctionScorer]:
    scorer = FunctionScorer(queued_s=queued_s)
    reranker = Reranker(request_rules(Settings(min_candidates=2)), scorer)
    query = RerankQuery(
        request_id="r",
        query="q",
        timeout_s=1.0,
        candidates=tuple(
            Candidate(id=f"d{i}", text=f"doc {i}", index=i, retrieval_rank=i + 1) for i in range(5)
        ),
    )
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
    assert re.search(
        r"behind the pairs ahead, past 90% of the (\d+ ms|1.0 s) budget$", summary.degraded.message
    ), summary.degraded.message
    assert scorer.seen == []  # nothing was sent
    # ... so nothing counts as submitted (it used to: 5 submitted, 0 scored, 0 failed)
    assert (summary.submitted, summary.scored, summary.failed) == (0, 0, 0)
    assert [r.candidate.id for r in results] == [f"d{i}" for i in range(5)]  # retrieval order
