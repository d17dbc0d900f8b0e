"""Two rerank-server processes behind one address, sharing a real redis-server, as a
fleet runs: a request one replica scored is answered by the other with no backend call;
the redis-server killed under load fails no request."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator

import httpx

from rerank_server.managed.child_process import free_port
from tests.fakes.llama import FakeLlamaServer
from tests.fakes.redis_server import RedisServer
from tests.server_process import server_process

DOCS = [f"passage {i} on what cats eat" for i in range(40)]


@contextlib.asynccontextmanager
async def one_address(*ports: int) -> AsyncIterator[int]:
    """A TCP load balancer on loopback: each new connection goes to the next port."""
    turn = itertools.cycle(ports)

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", next(turn))
        await asyncio.gather(pipe(client_r, server_w), pipe(server_r, client_w))

    balancer = await asyncio.start_server(handle, "127.0.0.1", 0)
    async with balancer:
        yield balancer.sockets[0].getsockname()[1]


async def rerank(port: int, docs: list[str]) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as http:  # one connection: one replica
        return await http.post(
            f"http://127.0.0.1:{port}/v1/rerank",
            json={"query": "what do cats eat?", "documents": docs},
        )


async def test_replicas_share_scores_and_survive_redis_dying(
    fake_llama: FakeLlamaServer, redis_server: RedisServer
) -> None:
    http_ports = free_port(), free_port()
    fleet = {
        "RERANK_CACHE_URL": redis_server.url(),
        "RERANK_CACHE_TIMEOUT_MS": "20",
        "RERANK_PROBE": "false",  # its pairs would count as backend calls
    }
    async with (
        server_process(fake_llama.url, RERANK_HTTP_PORT=str(http_ports[0]), **fleet),
        server_process(fake_llama.url, RERANK_HTTP_PORT=str(http_ports[1]), **fleet),
        one_address(*http_ports) as port,
    ):
        before = len(fake_llama.requests)
        first = await rerank(port, DOCS)
        assert first.status_code == 200 and first.json()["meta"]["reranked"]
        scored = len(fake_llama.requests)
        assert scored - before == len(DOCS)
        await asyncio.sleep(0.3)  # the first replica's writes go out in the background
        second = await rerank(port, DOCS)  # the other replica
        assert second.status_code == 200 and second.json()["meta"]["reranked"]
        assert len(fake_llama.requests) == scored, "the second replica scored again"
        assert second.json()["results"] == first.json()["results"]

        fake_llama.latency_s = 0.05
        load = [
            asyncio.ensure_future(rerank(port, [f"new {n} {d}" for d in DOCS[:10]]))
            for n in range(20)
        ]
        await asyncio.sleep(0.1)
        redis_server.kill()
        answers = await asyncio.gather(*load)
    assert all(a.status_code == 200 and a.json()["meta"]["reranked"] for a in answers)
