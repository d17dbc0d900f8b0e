"""Mapping between wire messages (`pb`) and domain types; the only core-facing pb user."""

from __future__ import annotations

import uuid

from .domain import (
    BlendStrategy,
    Candidate,
    DegradedCode,
    RankedCandidate,
    RerankQuery,
    RerankSummary,
)
from .pb import rerank_pb2 as pb

_BLEND_FROM_PB = {
    pb.BLEND_STRATEGY_POSITION_AWARE: BlendStrategy.POSITION_AWARE,
    pb.BLEND_STRATEGY_LINEAR: BlendStrategy.LINEAR,
    pb.BLEND_STRATEGY_RERANK_ONLY: BlendStrategy.RERANK_ONLY,
}
_BLEND_TO_PB = {v: k for k, v in _BLEND_FROM_PB.items()}
_DEGRADED_TO_PB = {
    DegradedCode.BACKEND_UNAVAILABLE: pb.DEGRADED_REASON_CODE_BACKEND_UNAVAILABLE,
    DegradedCode.TIMEOUT: pb.DEGRADED_REASON_CODE_TIMEOUT,
    DegradedCode.MALFORMED_RESPONSE: pb.DEGRADED_REASON_CODE_MALFORMED_RESPONSE,
    DegradedCode.BACKEND_ERROR: pb.DEGRADED_REASON_CODE_BACKEND_ERROR,
    DegradedCode.TOO_FEW_CANDIDATES: pb.DEGRADED_REASON_CODE_TOO_FEW_CANDIDATES,
    DegradedCode.DISABLED: pb.DEGRADED_REASON_CODE_DISABLED,
    DegradedCode.PARTIAL: pb.DEGRADED_REASON_CODE_PARTIAL,
}


def query_from_pb(request: pb.RerankRequest) -> RerankQuery:
    """The domain query; not yet validated (see `validation.validate`)."""
    options = request.options
    candidates = tuple(
        Candidate(
            id=c.id,
            text=c.text,
            index=i,
            retrieval_rank=c.retrieval_rank if c.HasField("retrieval_rank") else i + 1,
            title=c.title if c.HasField("title") else None,
            retrieval_score=c.retrieval_score if c.HasField("retrieval_score") else None,
            metadata=dict(c.metadata),
        )
        for i, c in enumerate(request.candidates)
    )
    return RerankQuery(
        request_id=request.request_id or uuid.uuid4().hex,
        query=request.query,
        candidates=candidates,
        top_k=request.top_k,
        instruction=request.instruction if request.HasField("instruction") else None,
        blend=_BLEND_FROM_PB.get(options.blend_strategy),
        max_candidates=options.max_candidates if options.HasField("max_candidates") else None,
        timeout_s=options.timeout_ms / 1000 if options.HasField("timeout_ms") else None,
        max_chunk_chars=options.max_chunk_chars if options.HasField("max_chunk_chars") else None,
        return_text=options.return_text,
    )


def result_to_pb(r: RankedCandidate) -> pb.RankedResult:
    c = r.candidate
    return pb.RankedResult(
        id=c.id, index=c.index, rank=r.rank, score=r.score,
        reranker_score=r.reranker_score, retrieval_score=c.retrieval_score,
        retrieval_rank=c.retrieval_rank, scored_text=r.scored_text, metadata=c.metadata)


def _summary_fields(s: RerankSummary) -> dict[str, object]:
    fields: dict[str, object] = {
        "request_id": s.request_id,
        "reranked": s.reranked,
        "backend": s.backend,
        "model": s.model,
        "blend_strategy": _BLEND_TO_PB[s.blend],
        "counts": pb.Counts(candidates=s.candidates, submitted=s.submitted, scored=s.scored,
                            failed=s.failed),
        "timings": pb.Timings(total_ms=s.total_ms, scoring_ms=s.scoring_ms),
    }
    if s.degraded is not None:
        fields["degraded"] = pb.DegradedReason(code=_DEGRADED_TO_PB[s.degraded.code],
                                               message=s.degraded.message)
    return fields


def summary_to_pb(s: RerankSummary) -> pb.RerankSummary:
    return pb.RerankSummary(**_summary_fields(s))  # type: ignore[arg-type]


def response_to_pb(results: list[RankedCandidate], s: RerankSummary) -> pb.RerankResponse:
    return pb.RerankResponse(results=[result_to_pb(r) for r in results],
                             **_summary_fields(s))  # type: ignore[arg-type]
