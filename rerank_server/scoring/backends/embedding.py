"""`embedding` backend: bi-encoder similarity through an OpenAI-style `/v1/embeddings`.

The score is the cosine clamped to 0..1; the instruction is not used (docs/backends.md).
"""

from __future__ import annotations

import asyncio
import binascii
import math
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import numpy as np
import pybase64
import structlog

from ...domain import BackendKind
from ..base import Emit, Failure, ScoreRequest
from ..transport.errors import BackendCallError, MalformedResponse
from ..transport.pool import BackendPool
from . import prompt
from .batching import score_in_batches
from .context_fit import ContextFit
from .pooled_scorer import PooledScorer

log = structlog.get_logger(__name__)

Vector = np.ndarray  # one embedding, float64


class EmbeddingScorer(PooledScorer):
    """Scores pairs by the cosine of query and document embeddings (`/v1/embeddings`)."""

    kind = BackendKind.EMBEDDING

    def __init__(self, pool: BackendPool, *, model: str = "", max_batch: int = 32) -> None:
        super().__init__(pool, model)
        self._max_batch = max_batch
        self._fit = ContextFit(pool)
        # Embeddings are asked for as base64 (OpenAI's `encoding_format`, which
        # llama-server, vLLM and TEI speak): a quarter of the bytes, and no float text
        # to parse (docs/backends.md). A backend that refuses the option gets floats
        # from then on; one that ignores it sends floats, which are read as well.
        self._base64 = True

    async def embed(self, texts: Sequence[str]) -> list[Vector | None]:
        """The embedding of each text, by the answer's `index`; None where it gave none.

        A refusal naming llama-server's physical batch (`-ub` below the context, which
        `/props` does not report) caps every later cut at it, and these texts are cut
        to it and sent once more, so one text longer than the physical batch does not
        fail a request's pairs."""
        try:
            return await self._embed_either(texts)
        except BackendCallError as exc:
            if not (exc.too_long and exc.limit_tokens):
                raise
            # Also when another request lowered the cap first: these were cut before.
            if self._fit.cap(exc.limit_tokens):
                log.warning(
                    "embedding_inputs_capped",
                    physical_batch=exc.limit_tokens,
                    advice="raise llama-server's -ub (and -b) to its context to "
                    "embed longer texts whole",
                )
        return await self._embed_either(await self._fit.fit(list(texts), ""))

    async def _embed_either(self, texts: Sequence[str]) -> list[Vector | None]:
        asked_base64 = self._base64
        try:
            return await self._embed(texts, asked_base64)
        except BackendCallError as exc:
            if not (asked_base64 and exc.status in (400, 422) and not exc.too_long):
                raise
        # Refused, maybe for the option: floats once, and from then on only if they are
        # taken (an input the backend refuses anyway was not about the option).
        vectors = await self._embed(texts, False)
        if self._base64:
            self._base64 = False
            log.warning("embedding_base64_refused", using="encoding_format float")
        return vectors

    async def _embed(self, texts: Sequence[str], as_base64: bool) -> list[Vector | None]:
        body = self.with_model({"input": list(texts)})
        if as_base64:
            body["encoding_format"] = "base64"
        return await self._pool.call(
            "/v1/embeddings",
            body,
            lambda a: self._vectors(a, len(texts)),
            pairs=len(texts),
            decode=_decode,
        )

    def _vectors(self, answer: _Answer, count: int) -> list[Vector | None]:
        data = answer.data
        if len(data) != count:
            raise MalformedResponse(f"expected {count} embeddings")
        self.note_model(answer.model)
        indexes = []
        for position, item in enumerate(data):
            index = position if item.index is None else item.index
            if not 0 <= index < count or not item.embedding:
                raise MalformedResponse("embedding entry without index or vector")
            indexes.append(index)
        vectors: list[Vector | None] = [None] * count
        named: set[int] = set()
        for index, vector in zip(indexes, _rows([item.embedding for item in data]), strict=True):
            # Named twice, a text has no vector: which entry is its own is unknown, and
            # taking either could score a document with another's vector.
            vectors[index] = None if index in named else vector
            named.add(index)
        return vectors

    async def score(self, request: ScoreRequest, emit: Emit) -> None:
        # Caller text is neutralized here too: BERT-style tokenizers parse [SEP], [CLS],
        # [MASK] in input text as special tokens (llama-server does).
        # Inputs cut to the model's context (a BERT-sized model reads 512 tokens; 2,000
        # characters of Chinese are about 2,000 of them).
        texts = await self._fit.fit(
            [prompt.neutralize(request.query), *map(prompt.neutralize, request.documents)],
            "",
            request.max_tokens_per_doc,
        )
        if len(texts) <= self._max_batch:
            # The query and every document in one call (the common request): one round
            # trip instead of two, and a third less of our CPU per request.
            async def together(
                _start: int,
                _documents: Sequence[str],
            ) -> Mapping[int, float | None]:
                vectors = await self.embed(texts)
                return _similarities(vectors[0], vectors[1:])

            await score_in_batches(texts[1:], len(texts), together, emit)
            return
        query = asyncio.ensure_future(self.embed(texts[:1]))

        async def call(_start: int, documents: Sequence[str]) -> Mapping[int, float | None]:
            vectors = await self.embed(documents)
            (q,) = await asyncio.shield(query)  # a failed query embedding fails the slice
            return _similarities(q, vectors)

        try:
            await score_in_batches(texts[1:], self._max_batch, call, emit)
        finally:
            if not query.done():
                query.cancel()
            elif not query.cancelled():
                query.exception()  # retrieved: reported through the slices already


def _similarities(
    query: Vector | None,
    vectors: Sequence[Vector | None],
) -> dict[int, float | None]:
    """`similarities`, with an answer that cannot be scored as a failed call."""
    try:
        if query is None:
            raise MalformedResponse("no embedding of the query")
        return similarities(query, vectors)
    except MalformedResponse as exc:
        raise BackendCallError(Failure.MALFORMED, str(exc)) from None


class _Embedding(msgspec.Struct, gc=False):
    """One entry of `data`: a base64 string of little-endian float32s, or the floats."""

    embedding: str | list[float]
    index: int | None = None  # the entry's position when absent


class _Answer(msgspec.Struct, gc=False):
    data: list[_Embedding]
    model: Any = None


# Only the fields read, into these types (`logprobs.decode_chat` says why): 384 floats as
# text are about 8 KB an embedding, decoded here in C rather than value by value.
_ANSWER = msgspec.json.Decoder(_Answer)


def _decode(body: bytes) -> _Answer:
    """A `/v1/embeddings` answer's bytes, decoded (`HttpBackend.post_json(decode=...)`):
    MalformedResponse for JSON of the wrong shape, msgspec.DecodeError for not JSON."""
    try:
        return _ANSWER.decode(body)
    except msgspec.ValidationError as exc:
        raise MalformedResponse(f"embeddings answer of the wrong shape ({exc})") from None


def _rows(embeddings: list[str | list[float]]) -> list[Vector]:
    """The embeddings as float64 vectors: those of one size as rows of one array, made
    with one conversion (a conversion per vector was most of the decoding's cost)."""
    try:
        raw = [
            pybase64.b64decode(e, validate=True) if isinstance(e, str) else None for e in embeddings
        ]
    except binascii.Error:
        raise MalformedResponse("embedding is neither floats nor base64 float32") from None
    blocks = [r for r in raw if r is not None]
    if (
        blocks
        and len(blocks) == len(raw)
        and len(blocks[0]) % 4 == 0
        and all(len(b) == len(blocks[0]) for b in blocks)
    ):
        return list(
            np.frombuffer(b"".join(blocks), dtype="<f4").astype(np.float64).reshape(len(blocks), -1)
        )
    return [_vector(e, r) for e, r in zip(embeddings, raw, strict=True)]


def _vector(embedding: str | list[float], raw: bytes | None) -> Vector:
    if raw is None:
        return np.asarray(embedding, dtype=np.float64)
    try:
        return np.frombuffer(raw, dtype="<f4").astype(np.float64)
    except ValueError:  # not a whole number of float32s
        raise MalformedResponse("embedding is neither floats nor base64 float32") from None


def similarities(query: Vector, vectors: Sequence[Vector | None]) -> dict[int, float | None]:
    """The cosine similarity of the query with each vector, clamped to 0..1, by position;
    None for a vector the answer left out or whose cosine is not a number (base64 can
    carry NaN). One matrix product for the whole slice, not cosines in Python loops."""
    present = [(i, v) for i, v in enumerate(vectors) if v is not None]
    if not present:
        return {}
    if any(v.shape != query.shape for _, v in present):
        raise MalformedResponse("embeddings of different sizes")
    matrix = np.stack([v for _, v in present])
    norms = np.linalg.norm(matrix, axis=1) * np.linalg.norm(query)
    with np.errstate(divide="ignore", invalid="ignore"):
        cosines = (matrix @ query) / norms
    scores: dict[int, float | None] = {}
    for (i, _), c, norm in zip(present, cosines.tolist(), norms.tolist(), strict=True):
        if norm == 0.0:  # an all-zero embedding is like nothing
            scores[i] = 0.0
        elif math.isfinite(c):
            scores[i] = max(0.0, min(1.0, c))
        else:
            scores[i] = None
    return scores
