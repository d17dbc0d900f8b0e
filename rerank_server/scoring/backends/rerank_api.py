"""`rerank` backend: the standard rerank endpoint, as Cohere's or TEI's shape.

Slices of `--max-batch`; scores outside 0..1 read as logits (docs/backends.md, "rerank").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ...domain import BackendKind
from ...settings import RerankFormat
from ..base import Emit, ScoreRequest
from ..transport.errors import MalformedResponse
from ..transport.pool import BackendPool
from . import prompt
from .batching import score_in_batches, to_unit
from .pooled_scorer import PooledScorer

LOGIT_ANSWERS = 3  # answers with scores outside 0..1 that make every score a logit


class RerankApiScorer(PooledScorer):
    """Scores pairs through a standard rerank endpoint, in Cohere's or TEI's shape."""

    kind = BackendKind.RERANK

    def __init__(
        self,
        pool: BackendPool,
        *,
        model: str = "",
        wire_format: RerankFormat = RerankFormat.COHERE,
        path: str = "/v1/rerank",
        max_batch: int = 32,
    ) -> None:
        super().__init__(pool, model)
        self._format = wire_format
        self._path = path
        self._max_batch = max_batch
        self._logit_answers = 0  # answers with a score outside 0..1, up to LOGIT_ANSWERS

    @property
    def variant(self) -> str:
        """Scores read as logits are keyed apart from the probabilities cached before the
        switch: the two scales must not meet in one ranking."""
        return "logits" if self._logit_answers >= LOGIT_ANSWERS else ""

    def payload(self, query: str, documents: Sequence[str]) -> dict[str, Any]:
        """The request body, caller text neutralized (a cross-encoder's tokenizer would
        read `[SEP]` in a document as the real separator)."""
        query = prompt.neutralize(query)
        documents = [prompt.neutralize(d) for d in documents]
        if self._format is RerankFormat.TEI:
            return {"query": query, "texts": documents, "raw_scores": False, "truncate": True}
        return self.with_model({"query": query, "documents": documents, "top_n": len(documents)})

    def parse(self, body: Any, count: int) -> dict[int, float]:
        if self._format is RerankFormat.TEI:
            entries, key = body, "score"
        elif isinstance(body, dict):
            entries, key = body.get("results"), "relevance_score"
            self.note_model(body.get("model"))
        else:
            entries = None
        if not isinstance(entries, list):
            raise MalformedResponse("rerank answer has no result list")
        scores: dict[int, float] = {}
        twice: set[int] = set()
        # An entry that is not an object, or lacks a whole index in range or a number,
        # fails its own pair only. Exact types, as JSON decodes them: a bool (an int to
        # isinstance) is neither an index nor a score.
        for entry in entries:
            if type(entry) is dict:
                index, value = entry.get("index"), entry.get(key)
                if (
                    type(index) is int
                    and 0 <= index < count
                    and (type(value) is float or type(value) is int)
                ):
                    if index in scores:
                        twice.add(index)
                    scores[index] = float(value)
        for index in twice:  # which of the two is the score? neither
            del scores[index]
        if self._logit_answers < LOGIT_ANSWERS and not all(
            0.0 <= v <= 1.0 for v in scores.values()
        ):
            self._logit_answers += 1
        return to_unit(scores, logits=self._logit_answers >= LOGIT_ANSWERS)

    async def score(self, request: ScoreRequest, emit: Emit) -> None:
        async def call(_start: int, documents: Sequence[str]) -> Mapping[int, float | None]:
            return await self._pool.call(
                self._path,
                self.payload(request.query, documents),
                lambda b: self.parse(b, len(documents)),
                pairs=len(documents),
            )

        await score_in_batches(request.documents, self._max_batch, call, emit, split_too_long=True)
