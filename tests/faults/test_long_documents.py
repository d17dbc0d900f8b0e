"""A backend that refuses a document as longer than its context: the pair is tried once
more with the document halved, instead of failing (the real-model cut to the context in
tokens is in tests/real/test_llama_server.py)."""

from __future__ import annotations

from rerank_client import AsyncRerankClient

from tests.fakes.llama import FakeLlamaServer


async def test_context_error_is_retried_with_a_shorter_document(
        client: AsyncRerankClient, fake_llama: FakeLlamaServer) -> None:
    fake_llama.max_document_chars = 500
    long_doc = "word " * 160  # 800 characters: refused whole, scored halved
    answer = await client.rerank("q", [long_doc, "short one", "short two"])
    assert answer.reranked and answer.summary.failed == 0
    lengths = sorted(len(d) for d in fake_llama.documents())
    assert lengths[-1] == 800 and 400 in lengths  # tried whole, then halved


async def test_a_document_too_long_even_halved_fails_alone_and_says_why(
        client: AsyncRerankClient, fake_llama: FakeLlamaServer) -> None:
    fake_llama.max_document_chars = 100
    answer = await client.rerank("q", ["word " * 160, "short one", "short two"])
    assert answer.reranked and answer.summary.failed == 1
    assert answer.summary.degraded_code == "partial"
    assert answer.summary.degraded_message == (
        "1 of 3 pairs failed (http_error: 1, HTTP 400: the document exceeds the model's "
        "context)")
