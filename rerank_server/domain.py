"""Domain types of the ranking core: immutable records, mapped to and from the wire only at
the edges (`api/convert.py`, `http_api/convert.py`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import NamedTuple

# The default `metadata` of every candidate without any: shared, so it must not change.
NO_METADATA: Mapping[str, str] = MappingProxyType({})


class BlendStrategy(StrEnum):
    """How a reranker score and a retrieval rank combine into the final score."""

    POSITION_AWARE = "position_aware"
    LINEAR = "linear"
    RERANK_ONLY = "rerank_only"
    ADAPTIVE = "adaptive"
    PROFILE = "profile"


class BackendKind(StrEnum):
    """Which protocol scores the pairs (docs/backends.md)."""

    CHAT = "chat"
    COMPLETION = "completion"
    RERANK = "rerank"
    EMBEDDING = "embedding"
    OLLAMA = "ollama"
    LLM = "llm"


class DegradedCode(StrEnum):
    """Why an answer was not (fully) reranked."""

    BACKEND_UNAVAILABLE = "backend_unavailable"
    TIMEOUT = "timeout"
    MALFORMED_RESPONSE = "malformed_response"
    BACKEND_ERROR = "backend_error"
    TOO_FEW_CANDIDATES = "too_few_candidates"
    DISABLED = "disabled"
    PARTIAL = "partial"
    WITHIN_TOP_K = "within_top_k"
    STRONG_SIGNAL = "strong_signal"
    OVERLOADED = "overloaded"
    SHUTTING_DOWN = "shutting_down"
    NO_RERANKER_WEIGHT = "no_reranker_weight"
    CAPPED = "capped"


class ScoreKind(StrEnum):
    """How a list's retrieval scores are brought to 0..1."""

    AUTO = "auto"  # similarity if every score is within 0..1, else lexical
    LEXICAL = "lexical"  # min-max within the list (BM25 and other unbounded scores)
    SIMILARITY = "similarity"  # clamped to 0..1 (cosine and other bounded scores)


class ThresholdMode(StrEnum):
    """How a threshold is applied: a fixed minimum, or lowered until enough pass."""

    FIXED = "fixed"
    ADAPTIVE = "adaptive"


class Candidate(NamedTuple):
    """One retrieval candidate, its retrieval rank resolved (given, or index + 1).

    A named tuple, as every record made per candidate is (docs/architecture.md, "The
    server"): compare candidates by their fields, not with plain tuples, and change one
    with `_replace`."""

    id: str
    text: str
    # Shadows tuple's `index` method, which nothing here calls: the position in the request.
    index: int  # type: ignore[assignment]
    retrieval_rank: int
    title: str | None = None
    retrieval_score: float | None = None
    metadata: Mapping[str, str] = NO_METADATA
    # Set by shaping: the retrieval score on 0..1, and the lists that found the candidate.
    normalized_score: float | None = None
    found_in: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class RankedList:
    """One retriever's (or one expanded query's) candidates, best first."""

    name: str
    candidates: tuple[Candidate, ...]
    weight: float | None = None
    expansion: bool = False
    score_kind: ScoreKind = ScoreKind.AUTO


@dataclass(frozen=True, slots=True)
class ThresholdSpec:
    """A requested threshold; `None` fields take the defaults in `shaping`."""

    mode: ThresholdMode
    min_score: float | None = None
    start: float | None = None
    step: float | None = None
    floor: float | None = None
    target_fraction: float | None = None


@dataclass(frozen=True, slots=True)
class ThresholdReport:
    """What a threshold did: the value applied, its lowering steps, how many passed."""

    threshold: float
    steps: int
    passed: int
    reached_floor: bool = False


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
    max_tokens_per_doc: int | None = None
    return_text: bool = False
    lists: tuple[RankedList, ...] = ()
    score_kind: ScoreKind = ScoreKind.AUTO
    fusion_k: int | None = None
    dedup_key: str = ""
    threshold: ThresholdSpec | None = None
    skip_within_top_k: bool | None = None
    strong_signal_skip: bool | None = None
    bypass_cache: bool = False
    always_score: bool = False

    @property
    def occurrences(self) -> int:
        """Candidates as received, over `candidates` and every list."""
        return len(self.candidates) + sum(len(lst.candidates) for lst in self.lists)


class RankedCandidate(NamedTuple):
    """A candidate in its final position (a named tuple, as `Candidate`)."""

    candidate: Candidate
    rank: int
    score: float
    reranker_score: float | None
    scored_text: str | None = None
    cached: bool = False


@dataclass(frozen=True, slots=True)
class Degraded:
    """Why an answer was not (fully) reranked: a code, and a message without user text."""

    code: DegradedCode
    message: str


@dataclass(frozen=True, slots=True)
class RerankSummary:
    """Everything about a finished request except its results."""

    request_id: str
    reranked: bool
    # Every reason the answer was not fully reranked, the main one first (PARTIAL and
    # CAPPED can both hold); empty when it was.
    degraded_reasons: tuple[Degraded, ...]
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
    cached: int = 0
    deduplicated: int = 0
    filtered: int = 0
    threshold: ThresholdReport | None = None
    # Name of the fitted blend profile that blended the request ("" when none did).
    blend_profile: str = ""
    # The reranker's weight in a request-wide blend (adaptive, profile); None otherwise.
    reranker_weight: float | None = None

    @property
    def degraded(self) -> Degraded | None:
        """The main reason the answer was not fully reranked; None when it was."""
        return self.degraded_reasons[0] if self.degraded_reasons else None
