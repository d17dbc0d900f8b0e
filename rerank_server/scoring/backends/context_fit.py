"""Documents cut to what the model can read, in tokens (llama-server `/props`, `/tokenize`).

How and why: docs/reliability.md, "Long documents never fail".
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog

from ..transport.errors import BackendCallError, MalformedResponse
from ..transport.pool import BackendPool

log = structlog.get_logger(__name__)

# Template tokens around the turns, the answer token, and boundary effects of counting a
# document apart from its prompt.
SAFETY_TOKENS = 32
MIN_BUDGET = 16
RELEARN_S = 30.0  # a backend that did not report its context is asked again after this
PROPS_RETRY_S = 2.0  # ... and one whose /props failed (loading, say), after this
BYTES_PER_TOKEN = 4  # English in most tokenizers; more tokens a byte for other scripts
NO_TOKENIZER = (404, 405, 501)  # statuses of a server without /tokenize


class ContextFit:
    """Cuts a request's documents to their token budget; learns the slot size once."""

    def __init__(self, pool: BackendPool) -> None:
        self._pool = pool
        self._slot_tokens: int | None = None
        self._next_try = 0.0
        self._asked = False  # whether /props has been asked (and answered or not) once
        self._lock = asyncio.Lock()
        self._tokenizer = True  # False once the backend had no /tokenize
        self._cap: int | None = None  # tokens: a limit the backend named in a refusal

    async def slot_tokens(self) -> int | None:
        """Context tokens per slot (llama-server `/props`), or None when not reported.
        Only the first asking is waited for by every request; while a later one is out
        (a backend that did not report, asked again every RELEARN_S), requests go on
        without: a slow `/props` made every request arriving meanwhile wait for it."""
        if self._slot_tokens is not None or (self._asked and self._lock.locked()):
            return self._slot_tokens
        async with self._lock:
            loop = asyncio.get_running_loop()
            if self._slot_tokens is None and loop.time() >= self._next_try:
                props = await self._pool.get_json("/props")
                # A failed asking (llama-server answers 503 while it loads) is soon
                # repeated: until it is answered, no document is cut to the slot.
                self._next_try = loop.time() + (PROPS_RETRY_S if props is None else RELEARN_S)
                settings = (
                    props.get("default_generation_settings") if isinstance(props, dict) else None
                )
                n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
                if isinstance(n_ctx, int) and n_ctx > 0:
                    self._slot_tokens = n_ctx
                self._asked = True
            return self._slot_tokens

    async def fit(
        self,
        documents: list[str],
        around: str,
        max_tokens_per_doc: int = 0,
    ) -> list[str]:
        """`documents`, each cut to its budget; `around` is the prompt text besides it."""
        budget = await self.budget(around, max_tokens_per_doc)
        if budget is None:
            return documents
        # Only the documents over the byte bound need the tokenizer, and a task each:
        # gathering every document made a task per pair on every request.
        longer = [
            i
            for i, doc in enumerate(documents)
            if len(doc) > budget // 4 and len(doc.encode()) > budget
        ]
        if not longer:
            return documents
        cut = await asyncio.gather(*(self._cut(documents[i], budget) for i in longer))
        fitted = list(documents)
        for i, doc in zip(longer, cut, strict=True):
            fitted[i] = doc
        return fitted

    async def budget(self, around: str, max_tokens_per_doc: int = 0) -> int | None:
        slot = await self.slot_tokens()
        limits = [max_tokens_per_doc] if max_tokens_per_doc else []
        for tokens in (slot, self._cap):
            if tokens is not None:
                limits.append(tokens - len(around.encode()) - SAFETY_TOKENS)
        return max(min(limits), MIN_BUDGET) if limits else None

    def cap(self, tokens: int) -> bool:
        """Hold every later budget to `tokens` (a limit the backend named); whether that
        lowered it."""
        if tokens <= 0 or (self._cap is not None and self._cap <= tokens):
            return False
        self._cap = tokens
        return True

    async def _cut(self, document: str, budget: int) -> str:
        if len(document.encode()) <= budget:
            return document  # at most one token per byte: it fits
        if self._tokenizer:
            try:
                tokens = await self._pool.call(
                    "/tokenize", {"content": document}, token_list, pairs=0
                )
                if len(tokens) <= budget:
                    return document
                cut = await self._pool.call(
                    "/detokenize", {"tokens": tokens[:budget]}, _content, pairs=0
                )
                return str(cut).rstrip("\ufffd")  # the half of a character the cut split
            except BackendCallError as exc:
                log.debug("tokenize_unavailable", error=exc.detail)
                if exc.status in NO_TOKENIZER:
                    self._tokenizer = False  # not asked again for every long document
                return _bytes(document, budget)  # the byte bound: always safe
        # No tokenizer: the byte bound where a limit is known (it must fit), else about
        # what `budget` tokens are.
        known = self._slot_tokens is not None or self._cap is not None
        return _bytes(document, budget if known else budget * BYTES_PER_TOKEN)


def _bytes(document: str, limit: int) -> str:
    """`document` cut to at most `limit` UTF-8 bytes, at a character boundary."""
    return document.encode()[:limit].decode(errors="ignore")


def shorter(document: str) -> str:
    """The document halved, for one more try after the backend said it was too long."""
    return document[: len(document) // 2]


def token_list(body: Any) -> list[int]:
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise MalformedResponse("/tokenize answer has no token list")
    return tokens


def _content(body: Any) -> str:
    content = body.get("content") if isinstance(body, dict) else None
    if not isinstance(content, str):
        raise MalformedResponse("/detokenize answer has no content")
    return content
