"""Domain types of the ranking core.

These are plain frozen dataclasses: the core (validation, chunking, scoring, blending,
ordering) works on them and never imports generated protobuf code. `convert.py` maps them
to and from the wire types at the service edge.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum


class BlendStrategy(StrEnum):
    """How a reranker score and a retrieval rank combine into the final score."""

    POSITION_AWARE = "position_aware"
    LINEAR = "linear"
    RERANK_ONLY = "rerank_only"


class DegradedCode(StrEnum):
    """Why an answer was not (fully) reranked."""

    BACKEND_UNAVAILABLE = "backend_unavailable"
    TIMEOUT = "timeout"
    MALFORMED_RESPONSE = "malformed_response"
    BACKEND_ERROR = "backend_error"
    TOO_FEW_CANDIDATES = "too_few_candidates"
    DISABLED = "disabled"
    PARTIAL = "partial"


@dataclass(frozen=True, slots=True)
class Candidate:
    """One retrieval candidate, its retrieval rank resolved (given, or index + 1)."""

    id: str
    text: str
    index: int
    retrieval_rank: int
    title: str | None = None
    retrieval_score: float | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RerankQuery:
    """A validated request. `None` options mean "use the server default"."""

    request_id: str
    query: str
    candidates: tuple[Candidate, ...]
    top_k: int = 0
    instruction: str | None = None
    blend: BlendStrategy | None = None
    max_candidates: int | None = None
    timeout_s: float | None = None
    max_chunk_chars: int | None = None
    return_text: bool = False


@dataclass(frozen=True, slots=True)
class RankedCandidate:
    """A candidate in its final position."""

    candidate: Candidate
    rank: int
    score: float
    reranker_score: float | None
    scored_text: str | None = None


@dataclass(frozen=True, slots=True)
class Degraded:
    code: DegradedCode
    message: str


@dataclass(frozen=True, slots=True)
class RerankSummary:
    """Everything about a finished request except its results."""

    request_id: str
    reranked: bool
    degraded: Degraded | None
    backend: str
    model: str
    blend: BlendStrategy
    candidates: int
    submitted: int
    scored: int
    failed: int
    total_ms: float
    scoring_ms: float
    # Failed pairs by failure kind ("timeout": 3), for metrics and logs.
    failures: Mapping[str, int] = field(default_factory=dict)
