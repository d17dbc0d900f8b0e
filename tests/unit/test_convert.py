"""Domain results to wire messages: every field set where the domain has it, and unset
(not zero) where it has none; the response holds them in order."""

from __future__ import annotations

import pytest

from rerank_server.api.convert import query_from_pb, response_to_pb, result_to_pb
from rerank_server.api.pb import rerank_pb2 as pb
from rerank_server.domain import BlendStrategy, Candidate, RankedCandidate, RerankSummary

FULL = RankedCandidate(
    candidate=Candidate(
        id="d7",
        text="text",
        index=7,
        retrieval_rank=3,
        title="t",
        retrieval_score=12.5,
        metadata={"lang": "en"},
        normalized_score=0.8,
        found_in=("bm25", "dense"),
    ),
    rank=1,
    score=0.9,
    reranker_score=0.95,
    scored_text="chunk",
    cached=True,
)
BARE = RankedCandidate(
    candidate=Candidate(id="d0", text="text", index=0, retrieval_rank=1),
    rank=2,
    score=0.0,
    reranker_score=None,
)


@pytest.mark.parametrize("ranked", [FULL, BARE], ids=["full", "bare"])
def test_result_is_the_message_built_from_every_field(ranked: RankedCandidate) -> None:
    c = ranked.candidate
    every_field = pb.RankedResult(
        id=c.id,
        index=c.index,
        rank=ranked.rank,
        score=ranked.score,
        reranker_score=ranked.reranker_score,
        retrieval_score=c.retrieval_score,
        retrieval_rank=c.retrieval_rank,
        scored_text=ranked.scored_text,
        metadata=c.metadata,
        normalized_retrieval_score=c.normalized_score,
        found_in=c.found_in,
        cached=ranked.cached,
    )
    assert result_to_pb(ranked) == every_field


def test_unset_optionals_stay_unset() -> None:
    message = result_to_pb(BARE)
    for name in ("reranker_score", "retrieval_score", "scored_text", "normalized_retrieval_score"):
        assert not message.HasField(name), name
    assert not message.metadata and not message.found_in
    full = result_to_pb(FULL)
    assert full.HasField("reranker_score") and full.reranker_score == 0.95
    assert dict(full.metadata) == {"lang": "en"} and list(full.found_in) == ["bm25", "dense"]


def test_response_holds_every_result_in_order() -> None:
    summary = RerankSummary(
        request_id="r",
        reranked=True,
        degraded_reasons=(),
        backend="chat",
        model="m",
        blend=BlendStrategy.POSITION_AWARE,
        candidates=2,
        submitted=2,
        scored=1,
        failed=0,
        total_ms=1.0,
        scoring_ms=0.5,
    )
    response = response_to_pb([FULL, BARE], summary)
    assert list(response.results) == [result_to_pb(FULL), result_to_pb(BARE)]
    assert response.request_id == "r" and response.counts.scored == 1


def test_wire_candidates_are_whole_candidates() -> None:
    """Read from the wire with `tuple.__new__` (no defaults filled in): each is equal to
    the candidate the named tuple's constructor makes, every field there."""
    request = pb.RerankRequest(
        query="q",
        candidates=[
            pb.Candidate(id="a", text="x"),
            pb.Candidate(
                id="b",
                text="y",
                title="t",
                retrieval_rank=4,
                retrieval_score=0.5,
                metadata={"k": "v"},
            ),
        ],
    )
    first, second = query_from_pb(request).candidates
    assert first == Candidate(id="a", text="x", index=0, retrieval_rank=1)
    assert second == Candidate(
        id="b",
        text="y",
        index=1,
        retrieval_rank=4,
        title="t",
        retrieval_score=0.5,
        metadata={"k": "v"},
    )
    assert len(first) == len(Candidate._fields) and repr(first).startswith("Candidate(")
    assert first._replace(found_in=("l",)).found_in == ("l",)
