"""Sixteen valid 12 MB requests at once: the server works on as many as
--max-inflight-bytes allows and refuses the rest with RESOURCE_EXHAUSTED, so its memory
stays bounded (docs/reliability.md has the measured RSS per MB received)."""

from __future__ import annotations

import asyncio
import collections

import grpc
import pytest
from rerank_client import AsyncRerankClient, RerankError

from rerank_server.api.pb import rerank_pb2 as pb
from rerank_server.api.pb import rerank_pb2_grpc as pb_grpc
from tests.conftest import StartServer
from tests.fakes.llama import FakeLlamaServer
from tests.faults.test_batch_backpressure import rss_mib
from tests.server_process import server_process

IN_FLIGHT_MIB = 64


def big_request(i: int) -> pb.RerankRequest:
    """About 12 MB: 4 lists of 100 candidates of 30,000 characters (all within limits)."""
    text = ("The quick brown fox jumps over the lazy dog. " * 700)[:30_000]
    lists = [pb.RankedList(name=f"l{n}", candidates=[
        pb.Candidate(id=f"{n}-{k}", text=text) for k in range(100)]) for n in range(4)]
    return pb.RerankRequest(request_id=str(i), query=f"fox {i}", lists=lists)


async def test_big_requests_at_once_keep_memory_bounded(fake_llama: FakeLlamaServer) -> None:
    fake_llama.latency_s = 0.05
    requests = [big_request(i) for i in range(16)]
    size_mib = requests[0].ByteSize() / 2**20
    codes: collections.Counter[str] = collections.Counter()
    options = [("grpc.max_send_message_length", 32 * 2**20)]
    async with server_process(fake_llama.url, RERANK_PROBE="0", RERANK_MAX_INFLIGHT_BYTES=str(
            IN_FLIGHT_MIB * 1024 * 1024)) as (port, proc), \
            grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        before = rss_mib(proc.pid)
        peak = before
        stub = pb_grpc.RerankerStub(channel)

        async def one(request: pb.RerankRequest) -> None:
            try:
                answer = await stub.Rerank(request, timeout=60)
                codes["OK reranked" if answer.reranked else "OK degraded"] += 1
            except grpc.aio.AioRpcError as exc:
                codes[exc.code().name] += 1

        calls = asyncio.gather(*(one(r) for r in requests))
        while not calls.done():
            peak = max(peak, rss_mib(proc.pid))
            await asyncio.sleep(0.05)
        await calls
    grown = peak - before
    print(f"{size_mib:.1f} MB requests, {dict(codes)}, RSS {before:.0f} -> {peak:.0f} MiB")
    assert 11 < size_mib < 16
    assert codes["OK reranked"] > 0, dict(codes)
    assert sum(codes.values()) == 16 and set(codes) <= {
        "OK reranked", "OK degraded", "RESOURCE_EXHAUSTED"}, dict(codes)
    # gRPC receives every message (and copies it once into Python) before the server can
    # refuse it; what the server then works on is bounded by the budget. Measured: 2.1 to
    # 2.6 MiB of RSS per MB received. Before the budget: about 50 MiB per such request.
    assert grown < 3.5 * 16 * size_mib, f"RSS grew {grown:.0f} MiB"


async def test_request_bytes_past_the_budget_are_refused(
        start_server: StartServer, fake_llama: FakeLlamaServer) -> None:
    fake_llama.latency_s = 0.5
    server = await start_server(max_inflight_bytes=100_000, concurrency=1)
    docs = ["x" * 20_000 for _ in range(3)]  # about 60 KB: one fits, two do not
    async with AsyncRerankClient(f"127.0.0.1:{server.port}") as client:
        first = asyncio.ensure_future(client.rerank("q1", docs))
        await asyncio.sleep(0.2)  # the first is being scored
        with pytest.raises(RerankError) as info:
            await client.rerank("q2", docs)
        assert (await first).reranked
        assert (await client.rerank("q3", docs)).reranked  # the budget is given back
    assert info.value.code == "RESOURCE_EXHAUSTED"
    assert "max_inflight_bytes" in info.value.message
