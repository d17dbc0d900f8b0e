"""`llm` backend: listwise scoring by a general chat model (OpenAI-compatible API).

One call per slice of `--max-batch`, read leniently, checked strictly (docs/backends.md).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from ...domain import BackendKind
from ..base import Emit, ScoreRequest
from ..transport.errors import MalformedResponse
from ..transport.pool import BackendPool
from . import prompt
from .batching import score_in_batches
from .pooled_scorer import PooledScorer

DOCUMENT_CHARS = 1000
SYSTEM = (
    "You are a search relevance judge. Score how well each numbered candidate "
    "answers the query, from 0 (irrelevant) to 1 (perfectly relevant). Reply with "
    'only a JSON array such as [{"index": 1, "score": 0.9}], one entry per '
    "candidate, and nothing else."
)


def user_prompt(instruction: str, query: str, documents: Sequence[str]) -> str:
    lines = [
        f"Task: {prompt.neutralize(instruction)}",
        f"Query: {prompt.neutralize(query)}",
        "",
        "Candidates:",
    ]
    for n, document in enumerate(documents, start=1):
        # One line per candidate: every line break Python knows (\r, \v, U+2028 ...), not
        # only \n, so that no document starts a line that reads as another candidate.
        text = " ".join(prompt.neutralize(document[:DOCUMENT_CHARS]).splitlines())
        lines.append(f"[{n}] {text}")
    return "\n".join(lines)


VARIANT = prompt.digest(SYSTEM, user_prompt(*prompt.SLOTS[:2], prompt.SLOTS[2:]))


def parse_scores(body: Any, count: int) -> dict[int, float | None]:
    """0-based index -> score for the entries that are well-formed and in range."""
    try:
        content = body["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise MalformedResponse("chat answer has no message content") from None
    if not isinstance(content, str):
        raise MalformedResponse("chat answer content is not text")
    entries = _first_array(content)
    if entries is None:
        raise MalformedResponse("the model's answer is not a JSON array")
    scores: dict[int, float | None] = {}
    for entry in entries:
        if not isinstance(entry, dict):
            continue
        index, score = entry.get("index"), entry.get("score")
        if not isinstance(index, int) or isinstance(index, bool) or not 1 <= index <= count:
            continue
        try:  # an integer of 400 digits is an int, and too large for a float
            value = (
                float(score)
                if isinstance(score, int | float) and not isinstance(score, bool)
                else None
            )
        except OverflowError:
            value = None
        ok = value is not None and 0 <= value <= 1
        # A repeated index makes both entries suspect: the candidate fails.
        scores[index - 1] = None if (index - 1) in scores or not ok else value
    return scores


_ARRAY_TRIES = 8  # "[" positions tried, each parse bounded by the answer's length


def _first_array(content: str) -> list[Any] | None:
    """The first JSON array of objects in `content`, read from one of its first
    `_ARRAY_TRIES` brackets to where the array ends: prose before or after it
    ("candidate [1] fits best", a closing "[done]") is not read. A model's text is
    steered by the documents it read, so what the parser may raise on it (a number of
    5,000 digits, nesting past the recursion limit) is no array, not a crash."""
    decoder = json.JSONDecoder()
    start = content.find("[")
    for _ in range(_ARRAY_TRIES):
        if start < 0:
            return None
        try:
            entries, _ = decoder.raw_decode(content, start)
        except (ValueError, RecursionError):
            start = content.find("[", start + 1)
            continue
        # A list with no object in it is prose ("candidate [1] fits best"), not scores.
        if isinstance(entries, list) and any(isinstance(e, dict) for e in entries):
            return entries
        start = content.find("[", start + 1)
    return None


class LlmScorer(PooledScorer):
    """Scores slices of candidates listwise through a general chat model's JSON answer."""

    kind = BackendKind.LLM

    def __init__(self, pool: BackendPool, *, model: str, max_batch: int = 20) -> None:
        super().__init__(pool, model)  # configured: a chat server may serve several
        self._max_batch = max_batch
        self._variant = VARIANT

    async def score(self, request: ScoreRequest, emit: Emit) -> None:
        async def call(_start: int, documents: Sequence[str]) -> Mapping[int, float | None]:
            body = {
                "model": self.model,
                "temperature": 0.1,
                "messages": [
                    {"role": "system", "content": SYSTEM},
                    {
                        "role": "user",
                        "content": user_prompt(request.instruction, request.query, documents),
                    },
                ],
            }
            return await self._pool.call(
                "/v1/chat/completions",
                body,
                lambda b: parse_scores(b, len(documents)),
                pairs=len(documents),
            )

        await score_in_batches(request.documents, self._max_batch, call, emit)
