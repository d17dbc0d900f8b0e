"""The backend pool over real HTTP: balancing, losing an instance mid-run without losing a
request, its return after recovery, and degrading at once when every instance is out."""

from __future__ import annotations

import asyncio
import time

from grpc_health.v1 import health_pb2

from rerank_server.api.grpc_server import backend_health_name
from rerank_server.server import RunningServer
from tests.conftest import StartServer, client_of
from tests.fakes.llama import FakeLlamaServer

POOL = {"eject_after": 2, "eject_base_s": 0.3, "health_interval_s": 0.2}


async def two_instance_server(
    start_server: StartServer, fakes: list[FakeLlamaServer], **settings: object
) -> RunningServer:
    return await start_server(backend_url=",".join(f.url for f in fakes), **POOL, **settings)


async def instance_status(server: RunningServer, fake_url: str) -> int:
    name = backend_health_name(fake_url.removeprefix("http://"))
    reply = await server.edge.health.Check(health_pb2.HealthCheckRequest(service=name), None)
    return int(reply.status)


async def eventually_status(server: RunningServer, fake_url: str, wanted: int) -> int:
    """The instance's health status once it is `wanted`, or the last seen after 5 s."""
    deadline = time.monotonic() + 5
    status = await instance_status(server, fake_url)
    while status != wanted and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        status = await instance_status(server, fake_url)
    return status


async def test_load_spreads_over_instances(start_server: StartServer) -> None:
    fakes = [FakeLlamaServer(latency_s=0.05).start() for _ in range(2)]
    try:
        server = await two_instance_server(start_server, fakes, concurrency=2)
        async with client_of(server) as client:
            await client.rerank("q", [f"doc {i}" for i in range(8)])
        assert [len(f.requests) for f in fakes] == [4, 4]
        assert max(f.max_in_flight for f in fakes) <= 2  # each instance's own limit
    finally:
        for f in fakes:
            f.stop()


async def test_losing_an_instance_mid_run_fails_no_request_and_it_comes_back(
    start_server: StartServer,
) -> None:
    _, b = fakes = [FakeLlamaServer(latency_s=0.01).start() for _ in range(2)]
    try:
        server = await two_instance_server(start_server, fakes)
        answers = []
        async with client_of(server) as client:
            for i in range(6):
                answers.append(await client.rerank(f"before {i}", ["x", "y", "z", "w"]))
            port = b.kill()
            served_by_b = len(b.requests)
            for i in range(10):
                answers.append(await client.rerank(f"during {i}", ["x", "y", "z", "w"]))
            assert all(ans.reranked and ans.summary.failed == 0 for ans in answers)
            assert server.pool.endpoints[1].ejections >= 1 or not server.pool.endpoints[1].healthy
            down = health_pb2.HealthCheckResponse.NOT_SERVING
            assert await eventually_status(server, f"http://127.0.0.1:{port}", down) == down

            b.revive(port)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and len(b.requests) == served_by_b:
                await asyncio.sleep(0.2)
                await client.rerank(f"after {time.monotonic()}", ["x", "y", "z", "w"])
            assert len(b.requests) > served_by_b, "the instance never came back"
            up = health_pb2.HealthCheckResponse.SERVING
            assert await eventually_status(server, b.url, up) == up
    finally:
        for f in fakes:
            f.stop()


async def test_with_every_instance_out_requests_degrade_at_once(start_server: StartServer) -> None:
    fakes = [FakeLlamaServer().start() for _ in range(2)]
    try:
        server = await two_instance_server(start_server, fakes, backend_timeout_ms=20_000)
        for f in fakes:
            f.kill()
        async with client_of(server) as client:
            await client.rerank("warm", ["x", "y", "z"])  # ejects, or health sees them gone
            down = health_pb2.HealthCheckResponse.NOT_SERVING
            for f in fakes:
                assert await eventually_status(server, f.url, down) == down
            started = time.perf_counter()
            answer = await client.rerank("q", ["x", "y", "z"])
            elapsed = time.perf_counter() - started
        assert not answer.reranked
        assert answer.summary.degraded_code == "backend_unavailable"
        # A 20 s call timeout was never waited for: nothing was sent at all.
        assert elapsed < 5
    finally:
        for f in fakes:
            f.stop()
