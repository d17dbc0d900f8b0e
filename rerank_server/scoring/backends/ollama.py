"""`ollama` backend: Ollama's `/api/generate`, the model answering a relevance number.

One call per pair; the first number in the answer / 10, clamped to 0..1, is the score.
"""

from __future__ import annotations

import re
from typing import Any

from ...domain import BackendKind
from ..base import Emit, PairOutcome, ScoreRequest
from ..transport.errors import BackendCallError, MalformedResponse
from ..transport.pool import BackendPool
from . import prompt
from .batching import map_pairs
from .pooled_scorer import PooledScorer

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
ANSWER_CHARS = 256  # of the answer searched for the number
INSTRUCTIONS = (
    "Judge how relevant the Document is to the Query, following the Instruct. "
    "Answer with one number from 0 (irrelevant) to 10 (perfectly relevant) "
    "and nothing else."
)


def generate_prompt(instruction: str, query: str, document: str) -> str:
    return (
        f"{INSTRUCTIONS}\n\n{prompt.user_message(instruction, query, document)}\n\n"
        "Relevance (0-10):"
    )


VARIANT = prompt.digest(generate_prompt(*prompt.SLOTS))


def relevance(body: Any) -> float:
    text = body.get("response") if isinstance(body, dict) else None
    if not isinstance(text, str):
        raise MalformedResponse("generate answer has no response text")
    # The number leads a short answer (a few tokens are asked for); a model that wrote
    # megabytes is not searched to their end (that would hold the event loop).
    match = NUMBER.search(text, 0, ANSWER_CHARS)
    if match is None:
        raise MalformedResponse("the model's answer holds no number")
    return max(0.0, min(1.0, float(match.group()) / 10))


class OllamaScorer(PooledScorer):
    """Scores pairs one call each through Ollama's `/api/generate`, as a number from 0 to 10."""

    kind = BackendKind.OLLAMA

    def __init__(self, pool: BackendPool, *, model: str) -> None:
        super().__init__(pool, model)  # configured: Ollama needs it in every call
        self._variant = VARIANT

    async def score(self, request: ScoreRequest, emit: Emit) -> None:
        async def one(i: int) -> PairOutcome:
            body = {
                "model": self.model,
                "stream": False,
                "prompt": generate_prompt(request.instruction, request.query, request.documents[i]),
                "options": {"temperature": 0, "num_predict": 8},
            }
            try:
                return PairOutcome(i, await self._pool.call("/api/generate", body, relevance))
            except BackendCallError as exc:
                return PairOutcome.failed(i, exc.failure, exc.detail)

        await map_pairs(len(request.documents), one, emit, self.calls)
