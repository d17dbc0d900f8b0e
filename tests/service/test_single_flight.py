"""Identical pairs in flight are scored once per process (`scoring/single_flight.py`):
concurrent requests for the same query and documents send each pair to the backend
once; a request whose pairs another request was scoring, and lost (its budget ran out),
sends them itself."""

from __future__ import annotations

import asyncio

from rerank_server.server import RunningServer
from tests.conftest import StartServer, client_of
from tests.fakes.llama import FakeLlamaServer

QUERY = "what do cats eat?"
DOCS = [f"passage {i} about cats and what they eat" for i in range(50)]


async def test_concurrent_identical_requests_send_each_pair_once(
    start_server: StartServer, fake_llama: FakeLlamaServer
) -> None:
    fake_llama.latency_s = 0.2
    server: RunningServer = await start_server(concurrency=8, timeout_ms=30_000)
    async with client_of(server) as client:
        answers = await asyncio.gather(*(client.rerank(QUERY, DOCS) for _ in range(10)))
    assert all(a.reranked and a.summary.scored == len(DOCS) for a in answers)
    assert all(a.summary.failed == 0 for a in answers)
    assert len(fake_llama.requests) == len(DOCS)  # not 10 x 50
    first = [(r.id, r.reranker_score) for r in answers[0].results]
    assert all([(r.id, r.reranker_score) for r in a.results] == first for a in answers)


async def test_pairs_another_request_lost_are_sent_by_the_one_that_waited(
    start_server: StartServer, fake_llama: FakeLlamaServer
) -> None:
    """The first request's budget (0.3 s) runs out before the backend (0.6 s a pair)
    answers; the second, with 20 s, waited on those pairs and gets every one scored."""
    fake_llama.latency_s = 0.6
    server = await start_server(concurrency=8, timeout_ms=20_000)
    async with client_of(server) as client:
        short = asyncio.create_task(client.rerank(QUERY, DOCS[:8], timeout_ms=300))
        await asyncio.sleep(0.05)  # its pairs are in flight
        long = await client.rerank(QUERY, DOCS[:8])
        hurried = await short
    assert not hurried.reranked or hurried.summary.failed > 0
    assert long.reranked and long.summary.scored == 8 and long.summary.failed == 0


async def test_different_queries_are_not_merged(
    start_server: StartServer, fake_llama: FakeLlamaServer
) -> None:
    fake_llama.latency_s = 0.1
    server = await start_server(concurrency=8)
    async with client_of(server) as client:
        await asyncio.gather(client.rerank(QUERY, DOCS[:5]), client.rerank("dogs", DOCS[:5]))
    assert len(fake_llama.requests) == 10
