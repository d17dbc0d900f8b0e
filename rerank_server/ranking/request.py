"""A request resolved once: every option merged with the server's default, every cap applied.

The core reads only this value, never the server's settings (`RequestRules`, built once).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..domain import BlendStrategy, Candidate, RankedList, ScoreKind, ThresholdSpec


@dataclass(frozen=True, slots=True)
class RequestRules:
    """The operator's limits and defaults for every request."""

    # Input limits: a request beyond them is INVALID_ARGUMENT.
    max_request_candidates: int
    max_query_chars: int
    max_document_chars: int
    max_id_chars: int
    max_lists: int
    max_metadata_entries: int
    max_metadata_key_chars: int
    max_metadata_value_chars: int
    max_metadata_request_chars: int
    # Defaults a request may override (and caps it may only lower).
    blend: BlendStrategy
    instruction: str
    timeout_s: float
    max_candidates: int
    max_chunk_chars: int
    max_tokens_per_doc: int  # 0: no limit but the model's context
    fusion_k: int
    original_list_weight: float
    expansion_list_weight: float
    skip_within_top_k: bool
    strong_signal_skip: bool
    # Server-wide rules no request changes.
    disabled: bool
    min_candidates: int
    strong_signal_min: float
    strong_signal_gap: float

    def echoable_id(self, request_id: str) -> str:
        """`request_id` as a refusal may log or echo it: "" when it is over its limit
        (which may be why the request is refused: an id of any size would otherwise go
        into the log line whole)."""
        return request_id if len(request_id) <= self.max_id_chars else ""


@dataclass(frozen=True, slots=True)
class SkipRules:
    """When a request is answered in retrieval order without scoring (`shaping.skip_reason`)."""

    disabled: bool
    min_candidates: int
    within_top_k: bool
    strong_signal: bool
    strong_signal_min: float
    strong_signal_gap: float


@dataclass(frozen=True, slots=True)
class Request:
    """A valid request with every option resolved; what the pipeline runs on."""

    request_id: str
    query: str
    # The request's own candidates, then its lists; every list's weight is resolved.
    candidates: tuple[Candidate, ...]
    lists: tuple[RankedList, ...]
    candidates_weight: float  # fusion weight of `candidates` when lists are fused with it
    top_k: int
    instruction: str
    blend: BlendStrategy
    max_candidates: int
    timeout_s: float
    max_chunk_chars: int
    max_tokens_per_doc: int
    return_text: bool
    score_kind: ScoreKind
    fusion_k: int
    dedup_key: str
    threshold: ThresholdSpec | None
    skip: SkipRules
    bypass_cache: bool
    always_score: bool  # score even when no score can change the answer

    @property
    def occurrences(self) -> int:
        """Candidates as received, over `candidates` and every list."""
        return len(self.candidates) + sum(len(lst.candidates) for lst in self.lists)
