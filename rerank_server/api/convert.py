"""Mapping between wire messages (`pb`) and domain types; the only core-facing pb user."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from ..domain import (
    NO_METADATA,
    BlendStrategy,
    Candidate,
    Degraded,
    DegradedCode,
    RankedCandidate,
    RankedList,
    RerankQuery,
    RerankSummary,
    ScoreKind,
    ThresholdMode,
    ThresholdSpec,
)
from ..errors import InvalidRequest
from .pb import rerank_pb2 as pb

_BLEND_FROM_PB = {
    pb.BLEND_STRATEGY_POSITION_AWARE: BlendStrategy.POSITION_AWARE,
    pb.BLEND_STRATEGY_LINEAR: BlendStrategy.LINEAR,
    pb.BLEND_STRATEGY_RERANK_ONLY: BlendStrategy.RERANK_ONLY,
    pb.BLEND_STRATEGY_ADAPTIVE: BlendStrategy.ADAPTIVE,
    pb.BLEND_STRATEGY_PROFILE: BlendStrategy.PROFILE,
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
    DegradedCode.WITHIN_TOP_K: pb.DEGRADED_REASON_CODE_WITHIN_TOP_K,
    DegradedCode.STRONG_SIGNAL: pb.DEGRADED_REASON_CODE_STRONG_SIGNAL,
    DegradedCode.OVERLOADED: pb.DEGRADED_REASON_CODE_OVERLOADED,
    DegradedCode.SHUTTING_DOWN: pb.DEGRADED_REASON_CODE_SHUTTING_DOWN,
    DegradedCode.NO_RERANKER_WEIGHT: pb.DEGRADED_REASON_CODE_NO_RERANKER_WEIGHT,
    DegradedCode.CAPPED: pb.DEGRADED_REASON_CODE_CAPPED,
}
_SCORE_KIND = {
    pb.SCORE_KIND_LEXICAL: ScoreKind.LEXICAL,
    pb.SCORE_KIND_SIMILARITY: ScoreKind.SIMILARITY,
}
_THRESHOLD_MODE = {
    pb.Threshold.MODE_FIXED: ThresholdMode.FIXED,
    pb.Threshold.MODE_ADAPTIVE: ThresholdMode.ADAPTIVE,
}


E = TypeVar("E")


def _enum(mapping: Mapping[Any, E], value: int, field: str, unset: E) -> E:
    """The domain value of a wire enum; UNSPECIFIED (0) is `unset`, an unknown number is
    INVALID_ARGUMENT (never quietly the default: a newer client may mean something else)."""
    if value == 0:
        return unset
    if value not in mapping:
        raise InvalidRequest(field, f"unknown value {value}")
    return mapping[value]


def _optional(message: Any, name: str) -> Any:
    return getattr(message, name) if message.HasField(name) else None


def _candidates(wire: Sequence[pb.Candidate], first_index: int) -> tuple[Candidate, ...]:
    """Domain candidates; `index` counts on from `first_index` over the whole request."""
    out: list[Candidate] = []
    append, new = out.append, _new
    # A loop with the presence checks inline, every field by position in `Candidate`'s
    # order (`tuple.__new__` instead of the named tuple's constructor, half its cost,
    # takes no defaults), no copy of an empty map: this runs for every candidate of every
    # request.
    for i, c in enumerate(wire):
        has = c.HasField
        metadata = c.metadata
        append(
            new(
                Candidate,
                (
                    c.id,
                    c.text,
                    first_index + i,
                    c.retrieval_rank if has("retrieval_rank") else i + 1,
                    c.title if has("title") else None,
                    c.retrieval_score if has("retrieval_score") else None,
                    dict(metadata) if metadata else NO_METADATA,
                    None,
                    (),  # normalized_score and found_in: `tuple.__new__` fills no default
                ),
            )
        )
    return tuple(out)


_new = tuple.__new__


def _lists(request: pb.RerankRequest) -> tuple[RankedList, ...]:
    lists = []
    first = len(request.candidates)
    named = {lst.name: i for i, lst in enumerate(request.lists) if lst.name}
    for i, lst in enumerate(request.lists):
        if not lst.name and f"list{i}" in named:
            # Said as it is, not as a clash with a name the caller never wrote.
            raise InvalidRequest(
                f"lists[{i}].name",
                f"not given, so 'list{i}', which "
                f"lists[{named[f'list{i}']}] gives as its name: name "
                "every list, or none",
            )
        lists.append(
            RankedList(
                name=lst.name or f"list{i}",
                candidates=_candidates(lst.candidates, first),
                weight=_optional(lst, "weight"),
                expansion=lst.expansion,
                score_kind=_enum(
                    _SCORE_KIND, lst.score_kind, f"lists[{i}].score_kind", ScoreKind.AUTO
                ),
            )
        )
        first += len(lst.candidates)
    return tuple(lists)


def _threshold(options: pb.RerankOptions) -> ThresholdSpec | None:
    t = options.threshold
    if not options.HasField("threshold"):
        return None
    mode = _enum(_THRESHOLD_MODE, t.mode, "options.threshold.mode", None)
    if mode is None:
        return None
    return ThresholdSpec(
        mode,
        min_score=_optional(t, "min_score"),
        start=_optional(t, "start"),
        step=_optional(t, "step"),
        floor=_optional(t, "floor"),
        target_fraction=_optional(t, "target_fraction"),
    )


def query_from_pb(request: pb.RerankRequest) -> RerankQuery:
    """The domain query; not yet validated (see `validation.validate`)."""
    options = request.options
    candidates = _candidates(request.candidates, 0)
    return RerankQuery(
        request_id=request.request_id or os.urandom(16).hex(),  # uuid4().hex: 4x the cost
        query=request.query,
        candidates=candidates,
        top_k=request.top_k,
        instruction=request.instruction if request.HasField("instruction") else None,
        blend=_enum(_BLEND_FROM_PB, options.blend_strategy, "options.blend_strategy", None),
        max_candidates=options.max_candidates if options.HasField("max_candidates") else None,
        timeout_s=options.timeout_ms / 1000 if options.HasField("timeout_ms") else None,
        max_chunk_chars=options.max_chunk_chars if options.HasField("max_chunk_chars") else None,
        max_tokens_per_doc=_optional(options, "max_tokens_per_doc"),
        return_text=options.return_text,
        lists=_lists(request),
        score_kind=_enum(_SCORE_KIND, options.score_kind, "options.score_kind", ScoreKind.AUTO),
        fusion_k=_optional(options, "fusion_k"),
        dedup_key=options.dedup_key,
        threshold=_threshold(options),
        skip_within_top_k=_optional(options, "skip_within_top_k"),
        strong_signal_skip=_optional(options, "strong_signal_skip"),
        bypass_cache=options.bypass_cache,
        always_score=options.always_score,
    )


def _fill_result(m: pb.RankedResult, r: RankedCandidate) -> None:
    """`r` into the empty message `m`: only the fields that are set, one assignment each
    (a quarter cheaper than keyword arguments through a dict, and upb's constructor
    costs about three times as much when handed None or an empty map or list)."""
    c = r.candidate
    m.id = c.id
    m.index = c.index
    m.rank = r.rank
    m.score = r.score
    m.retrieval_rank = c.retrieval_rank
    if r.cached:
        m.cached = True
    if r.reranker_score is not None:
        m.reranker_score = r.reranker_score
    if c.retrieval_score is not None:
        m.retrieval_score = c.retrieval_score
    if c.normalized_score is not None:
        m.normalized_retrieval_score = c.normalized_score
    if r.scored_text is not None:
        m.scored_text = r.scored_text
    if c.metadata:
        m.metadata.update(c.metadata)
    if c.found_in:
        m.found_in.extend(c.found_in)


def result_to_pb(r: RankedCandidate) -> pb.RankedResult:
    m = pb.RankedResult()
    _fill_result(m, r)
    return m


def _summary_fields(s: RerankSummary) -> dict[str, object]:
    fields: dict[str, object] = {
        "request_id": s.request_id,
        "reranked": s.reranked,
        "backend": s.backend,
        "model": s.model,
        "blend_strategy": _BLEND_TO_PB[s.blend],
        "blend_profile": s.blend_profile,
        "counts": pb.Counts(
            candidates=s.candidates,
            submitted=s.submitted,
            scored=s.scored,
            failed=s.failed,
            cached=s.cached,
            deduplicated=s.deduplicated,
            filtered=s.filtered,
        ),
        "timings": pb.Timings(total_ms=s.total_ms, scoring_ms=s.scoring_ms),
    }
    if s.threshold is not None:
        t = s.threshold
        fields["threshold"] = pb.ThresholdReport(
            threshold=t.threshold, steps=t.steps, passed=t.passed, reached_floor=t.reached_floor
        )
    if s.degraded_reasons:
        reasons = [_degraded_to_pb(d) for d in s.degraded_reasons]
        fields["degraded"], fields["degraded_reasons"] = reasons[0], reasons
    return fields


def _degraded_to_pb(d: Degraded) -> pb.DegradedReason:
    return pb.DegradedReason(code=_DEGRADED_TO_PB[d.code], message=d.message)


def summary_to_pb(s: RerankSummary) -> pb.RerankSummary:
    return pb.RerankSummary(**_summary_fields(s))  # type: ignore[arg-type]


def response_to_pb(results: list[RankedCandidate], s: RerankSummary) -> pb.RerankResponse:
    response = pb.RerankResponse(**_summary_fields(s))  # type: ignore[arg-type]
    add = response.results.add  # built in place: a list of messages would be copied in
    for r in results:
        _fill_result(add(), r)
    return response
