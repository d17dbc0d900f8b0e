"""Long documents: a backend that refuses one as longer than its context gets it again
halved, instead of the pair failing (the real-model cut to the context in tokens is in
tests/real/test_llama_server.py); and the most costly best-chunk search the limits allow
leaves the server responsive."""

from __future__ import annotations

import asyncio
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rerank_client import AsyncRerankClient

from tests.conftest import StartServer, client_of
from tests.fakes.llama import FakeLlamaServer
from tests.waiting import eventually


async def test_context_error_is_retried_with_a_shorter_document(
    client: AsyncRerankClient, fake_llama: FakeLlamaServer
) -> None:
    fake_llama.max_document_chars = 500
    long_doc = "word " * 160  # 800 characters: refused whole, scored halved
    answer = await client.rerank("q", [long_doc, "short one", "short two"])
    assert answer.reranked and answer.summary.failed == 0
    lengths = sorted(len(d) for d in fake_llama.documents())
    assert lengths[-1] == 800 and 400 in lengths  # tried whole, then halved


async def test_a_document_too_long_even_halved_fails_alone_and_says_why(
    client: AsyncRerankClient, fake_llama: FakeLlamaServer
) -> None:
    fake_llama.max_document_chars = 100
    answer = await client.rerank("q", ["word " * 160, "short one", "short two"])
    assert answer.reranked and answer.summary.failed == 1
    assert answer.summary.degraded_code == "partial"
    assert answer.summary.degraded_message == (
        "1 of 3 pairs failed (http_error: 1, HTTP 400: the document exceeds the model's context)"
    )


async def test_many_long_documents_of_short_sentences_leave_the_server_responsive(
    start_server: StartServer, fake_llama: FakeLlamaServer
) -> None:
    """The largest request the limits allow, made to cost the most in best-chunk search:
    100 documents of 128 KiB in 6-character sentences of the query's own words. It held
    the event loop for minutes (scoring each window afresh over every query term), and
    every other call and health check waited. Now it is cut in seconds, off the loop."""
    server = await start_server(max_candidates=100, max_message_bytes=16 << 20)
    query = " ".join(f"w{i:03d}" for i in range(800))  # 3,999 characters
    doc = "".join(f"w{i % 800:03d}. " for i in range(131_072 // 6))
    gaps: list[float] = []
    async with (
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
        client_of(server) as client,
    ):
        health = health_pb2_grpc.HealthStub(channel)
        call = asyncio.ensure_future(
            client.rerank(query, [doc] * 100, bypass_cache=True, timeout=300)
        )
        while not call.done():
            sent = time.monotonic()
            await health.Check(health_pb2.HealthCheckRequest(), timeout=60)
            gaps.append(time.monotonic() - sent)
            await asyncio.sleep(0.05)
        answer = await call
    assert answer.reranked and answer.summary.scored == 100
    assert all(len(d) <= 2000 for d in fake_llama.documents())
    # With the search on the event loop, no check is even sent while it runs.
    assert len(gaps) > 3 and max(gaps) < 1.0, (
        f"{len(gaps)} health checks during the request, the longest {max(gaps):.2f} s"
    )


async def test_a_deadline_counts_the_time_spent_before_scoring(
    start_server: StartServer, fake_llama: FakeLlamaServer
) -> None:
    """Cutting 30 long documents takes a while (0.5 s or so here) before any pair is
    sent; against a backend that never answers, the request must still answer, in
    retrieval order, within the caller's 3 s deadline. The scoring budget was the whole
    deadline counted from when scoring began, so the answer came that much too late:
    DEADLINE_EXCEEDED, no answer at all."""
    server = await start_server(max_candidates=100, max_message_bytes=16 << 20)
    fake_llama.latency_s = 60.0
    query = " ".join(f"w{i:03d}" for i in range(800))
    doc = "".join(f"w{i % 800:03d}. " for i in range(131_072 // 6))
    async with client_of(server) as client:
        sent = time.monotonic()
        answer = await client.rerank(query, [doc] * 30, bypass_cache=True, timeout=3.0)
        took = time.monotonic() - sent
    assert answer.summary.degraded_code == "timeout" and not answer.reranked
    before_scoring_ms = answer.summary.total_ms - answer.summary.scoring_ms
    assert before_scoring_ms > 100, "too fast to show anything: use longer documents"
    assert took < 3.0


async def test_a_request_behind_a_long_chunking_answers_within_its_deadline(
    start_server: StartServer, fake_llama: FakeLlamaServer
) -> None:
    """One thread searches long documents for their best chunk, and the costliest request
    the limits allow holds it for seconds. A small request behind it (its own documents
    long enough to go to that thread) waited its turn and answered after its 1.5 s
    deadline: DEADLINE_EXCEEDED. It now waits half its time at most, then scores the
    heads of its documents."""
    server = await start_server(max_candidates=100, max_message_bytes=16 << 20)
    query = " ".join(f"w{i:03d}" for i in range(800))
    costly = "".join(f"w{i % 800:03d}. " for i in range(131_072 // 6))
    small = [f"document {n}: " + "plain words of a long text. " * 2200 for n in range(3)]
    async with client_of(server) as client:
        blocking = asyncio.ensure_future(
            client.rerank(query, [costly] * 100, bypass_cache=True, timeout=300)
        )
        # In the pipeline (decoded and admitted), then a moment to reach the thread.
        assert await eventually(lambda: server.reranker.active == 1, 30)
        await asyncio.sleep(0.2)
        sent = time.monotonic()
        answer = await client.rerank("plain words", small, timeout=1.5)
        took = time.monotonic() - sent
        assert not blocking.done(), "the costly request ended first: nothing was tested"
        assert (await blocking).reranked
    assert answer.reranked and answer.summary.scored == 3 and took < 1.5
    heads = [d for d in fake_llama.documents() if d.startswith("document ")]
    assert sorted(heads) == sorted(d[:2000] for d in small)
