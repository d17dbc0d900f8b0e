"""Typed values of the client API, and their mapping to and from the wire messages."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .pb import rerank_pb2 as pb

BLEND_STRATEGIES = {
    "position_aware": pb.BLEND_STRATEGY_POSITION_AWARE,
    "linear": pb.BLEND_STRATEGY_LINEAR,
    "rerank_only": pb.BLEND_STRATEGY_RERANK_ONLY,
}
_BLEND_NAMES = {v: k for k, v in BLEND_STRATEGIES.items()}
_DEGRADED_PREFIX = "DEGRADED_REASON_CODE_"


@dataclass(frozen=True, slots=True)
class Candidate:
    """A document to rerank. `id` defaults to its position when built from a string."""

    id: str
    text: str
    title: str | None = None
    retrieval_score: float | None = None
    retrieval_rank: int | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)


CandidateLike = Candidate | str | Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Result:
    """One candidate in its final position."""

    id: str
    index: int
    rank: int
    score: float
    reranker_score: float | None
    retrieval_score: float | None
    retrieval_rank: int
    scored_text: str | None
    metadata: Mapping[str, str]

    @classmethod
    def from_pb(cls, r: pb.RankedResult) -> Result:
        return cls(
            id=r.id, index=r.index, rank=r.rank, score=r.score,
            reranker_score=r.reranker_score if r.HasField("reranker_score") else None,
            retrieval_score=r.retrieval_score if r.HasField("retrieval_score") else None,
            retrieval_rank=r.retrieval_rank,
            scored_text=r.scored_text if r.HasField("scored_text") else None,
            metadata=dict(r.metadata))


@dataclass(frozen=True, slots=True)
class Summary:
    """How a request went: whether it was reranked, why not, counts and timings."""

    request_id: str
    reranked: bool
    degraded_code: str | None
    degraded_message: str | None
    backend: str
    model: str
    blend_strategy: str
    candidates: int
    submitted: int
    scored: int
    failed: int
    total_ms: float
    scoring_ms: float

    @classmethod
    def from_pb(cls, s: pb.RerankSummary | pb.RerankResponse) -> Summary:
        degraded = s.degraded if s.HasField("degraded") else None
        return cls(
            request_id=s.request_id, reranked=s.reranked,
            degraded_code=(pb.DegradedReasonCode.Name(degraded.code)
                           .removeprefix(_DEGRADED_PREFIX).lower() if degraded else None),
            degraded_message=degraded.message if degraded else None,
            backend=s.backend, model=s.model,
            blend_strategy=_BLEND_NAMES.get(s.blend_strategy, "unspecified"),
            candidates=s.counts.candidates, submitted=s.counts.submitted,
            scored=s.counts.scored, failed=s.counts.failed,
            total_ms=s.timings.total_ms, scoring_ms=s.timings.scoring_ms)


@dataclass(frozen=True, slots=True)
class RerankAnswer:
    """The results in final order and the summary."""

    results: list[Result]
    summary: Summary

    @property
    def reranked(self) -> bool:
        return self.summary.reranked

    @classmethod
    def from_pb(cls, response: pb.RerankResponse) -> RerankAnswer:
        return cls([Result.from_pb(r) for r in response.results], Summary.from_pb(response))


def to_candidate(item: CandidateLike, position: int) -> Candidate:
    if isinstance(item, Candidate):
        return item
    if isinstance(item, str):
        return Candidate(id=str(position), text=item)
    data = dict(item)
    data.setdefault("id", str(position))
    data["id"] = str(data["id"])
    return Candidate(**data)


def build_request(query: str, candidates: Iterable[CandidateLike], *, top_k: int = 0,
                  instruction: str | None = None, request_id: str = "",
                  blend_strategy: str | None = None, max_candidates: int | None = None,
                  max_chunk_chars: int | None = None, timeout_ms: int | None = None,
                  return_text: bool = False) -> pb.RerankRequest:
    """The wire request; raises ValueError for an unknown blend strategy name."""
    if blend_strategy is not None and blend_strategy not in BLEND_STRATEGIES:
        raise ValueError(f"unknown blend strategy {blend_strategy!r}; "
                         f"choose from {', '.join(BLEND_STRATEGIES)}")
    options = pb.RerankOptions(
        blend_strategy=BLEND_STRATEGIES.get(blend_strategy or "",
                                            pb.BLEND_STRATEGY_UNSPECIFIED),
        max_candidates=max_candidates, max_chunk_chars=max_chunk_chars,
        timeout_ms=timeout_ms, return_text=return_text)
    wire = []
    for i, item in enumerate(candidates):
        c = to_candidate(item, i)
        wire.append(pb.Candidate(id=c.id, text=c.text, title=c.title,
                                 retrieval_score=c.retrieval_score,
                                 retrieval_rank=c.retrieval_rank, metadata=dict(c.metadata)))
    return pb.RerankRequest(request_id=request_id, query=query, candidates=wire, top_k=top_k,
                            instruction=instruction, options=options)


def stream_item(message: pb.RerankStreamMessage) -> Result | Summary:
    """One `RerankStream` message as the client's type: a result, or the closing summary."""
    if message.HasField("result"):
        return Result.from_pb(message.result)
    return Summary.from_pb(message.summary)
