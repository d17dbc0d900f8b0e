"""An in-process scorer for property tests: scores come from a function of the document.

It implements the `Scorer` protocol the way a backend does (outcomes through `emit`,
failures as failed pairs, never an exception), without sockets, so Hypothesis can run
hundreds of whole-pipeline examples in seconds. Tests that are about the wire use the
fake llama-server instead.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

from rerank_server.scoring.base import Emit, Failure, PairOutcome, ScoreRequest
from rerank_server.scoring.calls import CallTasks


def hashed_score(document: str) -> float:
    """A stable pseudo-random score in 0..1."""
    return int.from_bytes(hashlib.sha256(document.encode()).digest()[:4], "big") / 2**32


@dataclass
class FunctionScorer:
    score_of: Callable[[str], float] = hashed_score
    fails: Callable[[str], bool] = lambda _doc: False
    # Left out of the answer, as a malformed backend answer leaves a pair.
    omits: Callable[[str], bool] = lambda _doc: False
    kind: str = "function"
    model: str = "hash"
    variant: str = ""
    seen: list[str] = field(default_factory=list)
    closed: int = 0  # times `aclose` ran
    queued_s: float = 0.0  # what `estimate_s` says the backend's queue holds
    calls: CallTasks = field(default_factory=CallTasks)

    async def score(self, request: ScoreRequest, emit: Emit) -> None:
        for i, document in enumerate(request.documents):
            self.seen.append(document)
            if self.omits(document):
                continue
            if self.fails(document):
                emit(PairOutcome.failed(i, Failure.HTTP_ERROR, "HTTP 500"))
            else:
                emit(PairOutcome(i, self.score_of(document)))

    async def discover_model(self) -> None:
        pass

    def estimate_s(self, pairs: int, outstanding: int = 0) -> float:
        return self.queued_s  # in process: as busy as the test says

    async def aclose(self) -> None:
        self.closed += 1
