"""Client-side load balancing: with round_robin a channel spreads calls over every
address it resolves, as it does over a headless Service's pods (deploy/kubernetes)."""

from __future__ import annotations

from rerank_client import AsyncRerankClient

from tests.conftest import StartServer
from tests.fakes.llama import FakeLlamaServer


async def test_round_robin_spreads_calls_over_servers(start_server: StartServer) -> None:
    fakes = [FakeLlamaServer().start() for _ in range(2)]
    try:
        servers = [await start_server(backend_url=f.url) for f in fakes]
        target = "ipv4:" + ",".join(f"127.0.0.1:{s.port}" for s in servers)
        async with AsyncRerankClient(target, load_balancing="round_robin") as client:
            # round_robin uses the connections that are ready; the second may still be
            # connecting during the first calls.
            for i in range(20):
                await client.rerank(f"warm-up {i}", ["a", "b", "c"])
                if all(f.requests for f in fakes):
                    break
            for f in fakes:
                f.requests.clear()
            for i in range(6):
                await client.rerank(f"query {i}", ["a", "b", "c"])
        assert [len(f.requests) for f in fakes] == [9, 9]
    finally:
        for f in fakes:
            f.stop()


async def test_without_round_robin_one_channel_sticks_to_one_server(
    start_server: StartServer,
) -> None:
    fakes = [FakeLlamaServer().start() for _ in range(2)]
    try:
        servers = [await start_server(backend_url=f.url) for f in fakes]
        target = "ipv4:" + ",".join(f"127.0.0.1:{s.port}" for s in servers)
        async with AsyncRerankClient(target) as client:  # gRPC's default: pick_first
            for i in range(6):
                await client.rerank(f"query {i}", ["a", "b", "c"])
        assert sorted(len(f.requests) for f in fakes) == [0, 18]
    finally:
        for f in fakes:
            f.stop()
