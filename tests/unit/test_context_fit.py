"""Cutting documents to the model's context: only documents over the byte bound go to
the tokenizer, and each of those is cut at a token boundary."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from rerank_server.scoring.backends import context_fit
from rerank_server.scoring.backends.context_fit import SAFETY_TOKENS, ContextFit
from rerank_server.scoring.base import Failure
from rerank_server.scoring.transport.errors import BackendCallError


class Pool:
    """The two calls `ContextFit` makes of a backend pool, answered as llama-server does
    with one token per byte; anything else fails the test."""

    def __init__(self, n_ctx: int) -> None:
        self.n_ctx = n_ctx
        self.calls: list[str] = []

    async def get_json(self, path: str) -> Any:
        assert path == "/props"
        return {"default_generation_settings": {"n_ctx": self.n_ctx}}

    async def call(
        self, path: str, payload: Any, parse: Callable[[Any], Any], pairs: int = 1
    ) -> Any:
        self.calls.append(path)
        if path == "/tokenize":
            return parse({"tokens": list(payload["content"].encode())})
        assert path == "/detokenize"
        return parse({"content": bytes(payload["tokens"]).decode(errors="ignore")})


async def test_only_documents_over_the_byte_bound_are_tokenized() -> None:
    pool = Pool(n_ctx=100 + SAFETY_TOKENS)  # a budget of 100 tokens
    fit = ContextFit(pool)  # type: ignore[arg-type]
    documents = ["short", "x" * 100, "é" * 60, "y" * 150]  # 5, 100, 120 and 150 bytes
    fitted = await fit.fit(documents, "")
    assert fitted == ["short", "x" * 100, "é" * 50, "y" * 100]
    assert pool.calls == ["/tokenize", "/detokenize"] * 2  # the last two only


async def test_documents_that_all_fit_make_no_call() -> None:
    pool = Pool(n_ctx=2048)
    documents = ["a passage of about six hundred characters " * 14] * 40
    fitted = await ContextFit(pool).fit(documents, "around")  # type: ignore[arg-type]
    assert fitted == documents and pool.calls == []


async def test_a_later_asking_of_props_keeps_no_request_waiting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A backend that does not report its context is asked again every RELEARN_S; while
    that asking is out (a slow `/props`), requests go on without the slot size instead of
    waiting for it. The first asking is waited for by all."""
    monkeypatch.setattr(context_fit, "RELEARN_S", 0.0)
    monkeypatch.setattr(context_fit, "PROPS_RETRY_S", 0.0)
    release = asyncio.Event()

    class Silent(Pool):
        asked = 0

        async def get_json(self, path: str) -> Any:
            self.asked += 1
            if self.asked > 1:
                await release.wait()  # the second asking hangs
            return None

    pool = Silent(n_ctx=0)
    fit = ContextFit(pool)  # type: ignore[arg-type]
    assert await fit.slot_tokens() is None  # the first asking, answered at once
    hanging = asyncio.ensure_future(fit.slot_tokens())
    await asyncio.sleep(0.01)
    assert await asyncio.wait_for(fit.slot_tokens(), 1) is None  # not stuck behind it
    release.set()
    assert await hanging is None and pool.asked == 2


async def test_a_cut_that_splits_a_character_drops_its_half() -> None:
    """The token boundary fell inside "é": the backend's detokenized text ended in
    U+FFFD, which was sent as part of the document."""

    class Replacing(Pool):
        async def call(
            self, path: str, payload: Any, parse: Callable[[Any], Any], pairs: int = 1
        ) -> Any:
            if path == "/detokenize":
                return parse({"content": bytes(payload["tokens"]).decode(errors="replace")})
            return await super().call(path, payload, parse, pairs)

    fit = ContextFit(Replacing(n_ctx=101 + SAFETY_TOKENS))  # type: ignore[arg-type]
    assert await fit.fit(["é" * 60], "") == ["é" * 50]


async def test_a_backend_without_a_tokenizer_is_asked_once_and_cut_by_a_measure() -> None:
    """An OpenAI-compatible server (no /tokenize, no /props): `max_tokens_per_doc` of 16
    cut documents to 16 bytes, about 4 tokens, after a 404 for every long document; now
    one 404, then about 4 bytes a token."""

    class NoTokenizer(Pool):
        async def get_json(self, path: str) -> Any:
            return None

        async def call(
            self, path: str, payload: Any, parse: Callable[[Any], Any], pairs: int = 1
        ) -> Any:
            self.calls.append(path)
            raise BackendCallError(Failure.HTTP_ERROR, "HTTP 404", 404)

    pool = NoTokenizer(n_ctx=0)
    fit = ContextFit(pool)  # type: ignore[arg-type]
    first = await fit.fit(["a" * 200], "", max_tokens_per_doc=16)
    assert first == ["a" * 16]  # the byte bound while it could not tell: safe
    later = await fit.fit(["b" * 200, "c" * 200], "", max_tokens_per_doc=16)
    assert later == ["b" * 64, "c" * 64]
    assert pool.calls == ["/tokenize"]


async def test_a_failed_props_is_asked_again_soon(monkeypatch: pytest.MonkeyPatch) -> None:
    """llama-server answers /props with 503 while it loads: the slot size was then not
    asked again for 30 s, and documents went uncut (every long one refused)."""
    monkeypatch.setattr(context_fit, "PROPS_RETRY_S", 0.05)
    answers: list[Any] = [None, {"default_generation_settings": {"n_ctx": 512}}]

    class Loading(Pool):
        async def get_json(self, path: str) -> Any:
            return answers.pop(0)

    fit = ContextFit(Loading(n_ctx=512))  # type: ignore[arg-type]
    assert await fit.slot_tokens() is None
    await asyncio.sleep(0.1)
    assert await fit.slot_tokens() == 512
