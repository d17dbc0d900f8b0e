"""Properties of the whole pipeline (shaping, cap, scoring, blending, ordering) over
random requests: what comes out is the unique input, top_k is respected, and a degraded
answer is exactly the retrieval order."""

from __future__ import annotations

import asyncio
import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from rerank_server.domain import (
    BlendStrategy,
    Candidate,
    RankedCandidate,
    RankedList,
    RerankQuery,
    RerankSummary,
)
from rerank_server.ranking.pipeline import Reranker
from rerank_server.ranking.shaping import shape
from rerank_server.ranking.validation import resolve
from rerank_server.server import request_rules
from rerank_server.settings import Settings
from tests.fakes.scorer import FunctionScorer

IDS = st.text("abcdefghijklmnop", min_size=1, max_size=2)


@st.composite
def requests(draw: st.DrawFn) -> RerankQuery:
    """Up to three lists of overlapping ids, maybe plain candidates too, any top_k."""
    index = 0

    def candidates(ids: list[str]) -> tuple[Candidate, ...]:
        nonlocal index
        out = []
        for rank, cid in enumerate(ids, start=1):
            score = draw(st.none() | st.floats(0, 30, allow_nan=False))
            out.append(
                Candidate(
                    id=cid,
                    text=f"doc {cid}",
                    index=index,
                    retrieval_rank=rank,
                    retrieval_score=score,
                )
            )
            index += 1
        return tuple(out)

    unique_ids = st.lists(IDS, unique=True, max_size=12)
    plain = candidates(draw(unique_ids))
    lists = tuple(
        RankedList(f"list{i}", candidates(draw(unique_ids)), expansion=draw(st.booleans()))
        for i in range(draw(st.integers(0, 3)))
    )
    return RerankQuery(
        request_id="r",
        query="q",
        candidates=plain,
        lists=lists,
        top_k=draw(st.integers(0, 15)),
        blend=draw(st.sampled_from(list(BlendStrategy))),
        max_candidates=draw(st.none() | st.integers(1, 20)),
    )


def run(
    query: RerankQuery,
    scorer: FunctionScorer,
) -> tuple[list[RankedCandidate], RerankSummary]:
    reranker = Reranker(request_rules(Settings(min_candidates=2)), scorer)

    async def collect() -> tuple[list[RankedCandidate], RerankSummary]:
        answer = await reranker.answer(query)
        # The pipeline ran to its end, not left for the loop's finalizer to close: the
        # request no longer counts as active (the budget of the next ones reads it).
        assert reranker.active == 0
        return answer

    return asyncio.run(collect())


def unique_ids(query: RerankQuery) -> set[str]:
    return {c.id for c in query.candidates} | {c.id for lst in query.lists for c in lst.candidates}


@settings(max_examples=150, deadline=None)
@given(requests())
def test_output_is_the_unique_input_within_top_k(query: RerankQuery) -> None:
    results, summary = run(query, FunctionScorer())
    ids = [r.candidate.id for r in results]
    assert len(ids) == len(set(ids)), "an id came back twice"
    everything = unique_ids(query)
    if query.top_k:
        assert len(ids) == min(query.top_k, len(everything))
        assert set(ids) <= everything
    else:
        assert set(ids) == everything
    assert [r.rank for r in results] == list(range(1, len(results) + 1))
    assert summary.candidates == query.occurrences
    assert summary.deduplicated == query.occurrences - len(everything)


@settings(max_examples=150, deadline=None)
@given(requests())
def test_degraded_answer_is_exactly_the_retrieval_order(query: RerankQuery) -> None:
    results, summary = run(query, FunctionScorer(fails=lambda _doc: True))
    assert not summary.reranked
    expected = [c.id for c in shape(resolve(query, request_rules(Settings()))).candidates]
    if query.top_k:
        expected = expected[: query.top_k]
    assert [r.candidate.id for r in results] == expected


@settings(max_examples=100, deadline=None)
@given(requests())
def test_no_pair_is_scored_twice_in_one_request(query: RerankQuery) -> None:
    scorer = FunctionScorer()
    run(dataclasses.replace(query, bypass_cache=True), scorer)
    assert len(scorer.seen) == len(set(scorer.seen))
