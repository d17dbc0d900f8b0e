"""`embedding` backend: bi-encoder similarity through an OpenAI-style `/v1/embeddings`.

The query is embedded once per request; documents go in batches of `--max-batch`, all
calls at once. The score is the cosine similarity of query and document, clamped to
0..1 (for sentence-embedding models negative cosines are rare and mean "unrelated").
A cheap real reranker for CPU deployments: llama-server `--embedding --pooling mean` with
MiniLM-L6 (`rerank-server prepare --embedding-model` converts one into the cache).
The instruction is not used: symmetric embedding models take none.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping, Sequence
from typing import Any

from ..domain import BackendKind
from . import prompt
from .backend_pool import BackendPool
from .base import Emit, Failure, ScoreRequest
from .batching import score_in_batches
from .context_fit import ContextFit
from .http import BackendCallError, MalformedResponse
from .pooled_scorer import PooledScorer

Vector = list[float]


class EmbeddingScorer(PooledScorer):
    kind = BackendKind.EMBEDDING

    def __init__(self, pool: BackendPool, *, model: str = "", max_batch: int = 32) -> None:
        super().__init__(pool, model)
        self._max_batch = max_batch
        self._fit = ContextFit(pool)

    async def embed(self, texts: Sequence[str]) -> list[Vector]:
        body = self.with_model({"input": list(texts)})
        return await self._pool.call("/v1/embeddings", body,
                                     lambda b: self._vectors(b, len(texts)), pairs=len(texts))

    def _vectors(self, body: Any, count: int) -> list[Vector]:
        data = body.get("data") if isinstance(body, dict) else None
        if not isinstance(data, list) or len(data) != count:
            raise MalformedResponse(f"expected {count} embeddings")
        self.note_model(body.get("model"))
        vectors: list[Vector | None] = [None] * count
        for position, item in enumerate(data):
            index = item.get("index", position) if isinstance(item, dict) else None
            vector = item.get("embedding") if isinstance(item, dict) else None
            if not isinstance(index, int) or not 0 <= index < count or \
                    not isinstance(vector, list) or not vector:
                raise MalformedResponse("embedding entry without index or vector")
            vectors[index] = [float(x) for x in vector]
        return [v for v in vectors if v is not None]

    async def score(self, request: ScoreRequest, emit: Emit) -> None:
        # Caller text is neutralized here too: BERT-style tokenizers parse [SEP], [CLS],
        # [MASK] in input text as special tokens (llama-server does).
        # Inputs cut to the model's context (a BERT-sized model reads 512 tokens; 2,000
        # characters of Chinese are about 2,000 of them).
        texts = await self._fit.fit(
            [prompt.neutralize(request.query), *map(prompt.neutralize, request.documents)],
            "", request.max_tokens_per_doc)
        query = asyncio.ensure_future(self.embed(texts[:1]))

        async def call(_start: int, documents: Sequence[str]) -> Mapping[int, float | None]:
            vectors = await self.embed(documents)
            (q,) = await asyncio.shield(query)  # a failed query embedding fails the slice
            try:
                return {i: max(0.0, min(1.0, cosine(q, v))) for i, v in enumerate(vectors)}
            except MalformedResponse as exc:
                raise BackendCallError(Failure.MALFORMED, str(exc)) from None

        try:
            await score_in_batches(texts[1:], self._max_batch, call, emit)
        finally:
            if not query.done():
                query.cancel()
            elif not query.cancelled():
                query.exception()  # retrieved: reported through the slices already


def cosine(a: Vector, b: Vector) -> float:
    if len(a) != len(b):
        raise MalformedResponse("embeddings of different sizes")
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0
