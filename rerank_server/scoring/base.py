"""The interface every scoring backend implements, and the outcome of one pair."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple, Protocol

from ..domain import DegradedCode
from .calls import CallTasks


class Failure(StrEnum):
    """Why a pair got no score; each maps to a degraded reason."""

    UNAVAILABLE = "unavailable"
    TIMEOUT = "timeout"
    HTTP_ERROR = "http_error"
    MALFORMED = "malformed"
    SHUTTING_DOWN = "shutting_down"  # not scored because the server is stopping

    @property
    def degraded_code(self) -> DegradedCode:
        return _DEGRADED[self]


_DEGRADED = {
    Failure.UNAVAILABLE: DegradedCode.BACKEND_UNAVAILABLE,
    Failure.TIMEOUT: DegradedCode.TIMEOUT,
    Failure.HTTP_ERROR: DegradedCode.BACKEND_ERROR,
    Failure.MALFORMED: DegradedCode.MALFORMED_RESPONSE,
    Failure.SHUTTING_DOWN: DegradedCode.SHUTTING_DOWN,
}


class PairOutcome(NamedTuple):
    """The result for pair `pair`: a score on 0..1, or a failure with a short detail.

    `detail` names what went wrong (an exception type, an HTTP status); it never holds
    query or document text. A named tuple: one is made per pair, at under half the cost
    of a frozen dataclass.
    """

    pair: int
    score: float | None
    failure: Failure | None = None
    detail: str = ""

    @classmethod
    def failed(cls, pair: int, failure: Failure, detail: str) -> PairOutcome:
        return cls(pair, None, failure, detail)


@dataclass(frozen=True, slots=True)
class ScoreRequest:
    """Pairs to score: one query against `documents` (already chunked and titled).

    `max_tokens_per_doc` (0: none) caps each document's tokens; scorers also cut documents
    to what the model's context per slot leaves (`context_fit.py`).
    """

    query: str
    instruction: str
    documents: Sequence[str]
    max_tokens_per_doc: int = 0


Emit = Callable[[PairOutcome], None]


class Scorer(Protocol):
    """A scoring backend.

    `score` reports each pair's outcome through `emit` as soon as it is known, and
    returns when every pair is reported. It is cancelled when the request's time budget
    runs out; pairs not yet reported then count as timed out. It must not raise for
    backend trouble: that is a failed pair.
    """

    @property
    def kind(self) -> str: ...

    @property
    def model(self) -> str: ...

    @property
    def variant(self) -> str:
        """What the scores depend on besides the model and the pair ("" for nothing): the
        prompt's fixed text and settings, the scale scores are read on. A part of every
        score-cache key, so that a change of any of them (a release that rewords the
        prompt, `--no-assistant-prefill`) does not answer from scores of the old one."""
        ...

    @property
    def calls(self) -> CallTasks:
        """The tasks that make their backend calls themselves (the pool's): the scorer's
        own task is registered there while it scores."""
        ...

    async def score(self, request: ScoreRequest, emit: Emit) -> None: ...

    def estimate_s(self, pairs: int, outstanding: int = 0) -> float:
        """Seconds until `pairs` more pairs would be scored, behind the work already queued
        and in flight (0 when unknown), or behind `outstanding` pairs if that is more (the
        caller's count of pairs it has admitted and not yet seen scored, some of which
        may not have reached the scorer yet). Admission compares it with a request's
        budget."""
        ...

    async def discover_model(self) -> None:
        """Learn the model's name from the backend when it was not configured.

        Best effort, called when the backend comes up: the name goes into responses and
        into score-cache keys, so scores survive a restart only if it is known before the
        first request. Never raises.
        """

    async def aclose(self) -> None: ...
