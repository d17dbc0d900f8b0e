"""Memory under large requests (docs/reliability.md, "Memory is bounded"): sixteen valid
12 MB requests at once are worked on as far as --max-inflight-bytes allows, the rest
refused before they are read; 256 senders of valid requests at once, on either edge,
stay under the manifests' limit, each answered; floods of maximal requests, refused and
valid, on both edges, stay under the bound the manifests are sized by and end near where
they started."""

from __future__ import annotations

import asyncio
import collections
import json
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import httpx
import pytest
from rerank_client import RerankError

from rerank_server.api.pb import rerank_pb2 as pb
from rerank_server.api.pb import rerank_pb2_grpc as pb_grpc
from rerank_server.managed.child_process import free_port
from tests.conftest import StartServer, client_of
from tests.fakes.llama import FakeLlamaServer
from tests.faults.test_batch_backpressure import rss_mib
from tests.server_process import server_process

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from check_deploy import memory_estimate

IN_FLIGHT_MIB = 64


def big_request(i: int) -> pb.RerankRequest:
    """About 12 MB: 4 lists of 100 candidates of 30,000 characters (all within limits)."""
    text = ("The quick brown fox jumps over the lazy dog. " * 700)[:30_000]
    lists = [
        pb.RankedList(
            name=f"l{n}", candidates=[pb.Candidate(id=f"{n}-{k}", text=text) for k in range(100)]
        )
        for n in range(4)
    ]
    return pb.RerankRequest(request_id=str(i), query=f"fox {i}", lists=lists)


async def test_big_requests_at_once_keep_memory_bounded(fake_llama: FakeLlamaServer) -> None:
    fake_llama.latency_s = 0.05
    requests = [big_request(i) for i in range(16)]
    size_mib = requests[0].ByteSize() / 2**20
    codes: collections.Counter[str] = collections.Counter()
    options = [("grpc.max_send_message_length", 32 * 2**20)]
    async with (
        server_process(
            fake_llama.url,
            RERANK_PROBE="0",
            RERANK_MAX_INFLIGHT_BYTES=str(IN_FLIGHT_MIB * 1024 * 1024),
            RERANK_MAX_MESSAGE_BYTES=str(16 << 20),
        ) as (port, proc),
        grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel,
    ):
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
    print(f"{size_mib:.1f} MB requests, {dict(codes)}, RSS {before:.0f} -> {peak:.0f} MiB")
    assert 11 < size_mib < 16
    assert codes["OK reranked"] > 0, dict(codes)
    assert sum(codes.values()) == 16 and set(codes) <= {
        "OK reranked",
        "OK degraded",
        "RESOURCE_EXHAUSTED",
    }, dict(codes)
    # A message is read only once the budget has room for the largest one: those refused
    # are refused unread, so the bound does not count the messages sent.
    bound = memory_estimate(
        {
            "RERANK_MAX_INFLIGHT_BYTES": str(IN_FLIGHT_MIB * 1024 * 1024),
            "RERANK_MAX_MESSAGE_BYTES": str(16 << 20),
        }
    )
    assert peak < bound / 2**20, f"peak {peak:.0f} MiB"


async def test_request_bytes_past_the_budget_are_refused(
    start_server: StartServer, fake_llama: FakeLlamaServer
) -> None:
    fake_llama.latency_s = 0.5
    server = await start_server(max_inflight_bytes=100_000, concurrency=1)
    docs = ["x" * 20_000 for _ in range(3)]  # about 60 KB: one fits, two do not
    async with client_of(server) as client:
        first = asyncio.ensure_future(client.rerank("q1", docs))
        await asyncio.sleep(0.2)  # the first is being scored
        with pytest.raises(RerankError) as info:
            await client.rerank("q2", docs)
        assert (await first).reranked
        assert (await client.rerank("q3", docs)).reranked  # the budget is given back
    assert info.value.code == "RESOURCE_EXHAUSTED"
    assert "max_inflight_bytes" in info.value.message


async def test_a_batch_stream_kept_open_holds_no_room_while_it_sends_nothing(
    start_server: StartServer,
) -> None:
    """A RerankBatch stream holds room for its next request while it reads it; one whose
    client sends nothing more gives the room back (after `BATCH_QUIET_S`), so streams kept
    open for later requests do not keep others waiting. Here the room for one message is
    the whole budget: a Rerank call sent meanwhile is answered."""
    server = await start_server(max_inflight_bytes=1 << 20, max_message_bytes=1 << 20)
    more: asyncio.Queue[pb.RerankRequest | None] = asyncio.Queue()

    async def requests() -> AsyncIterator[pb.RerankRequest]:
        while (request := await more.get()) is not None:
            yield request

    small = pb.RerankRequest(
        request_id="b0", query="q", candidates=[pb.Candidate(id=str(i), text="t") for i in range(3)]
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.RerankerStub(channel)
        batch = stub.RerankBatch(requests())
        await more.put(small)
        first = await asyncio.wait_for(batch.read(), 10)
        assert first.request_id == "b0" and not first.HasField("error")
        started = time.monotonic()  # the stream, open, waits for its next request
        answer = await stub.Rerank(small, timeout=10)
        waited = time.monotonic() - started
        await more.put(None)
        assert await batch.read() is grpc.aio.EOF
    assert len(answer.results) == 3
    assert waited < 5, f"the Rerank call waited {waited:.1f} s"


SENDERS = 256  # at once, each on its own connection: beyond what the budget takes
MANIFEST_LIMIT_MIB = 512  # deploy/kubernetes: the rerank-server container's limit
RETRY_HINT = "retry with backoff"


def valid_request() -> pb.RerankRequest:
    """About 3.7 MB: 100 candidates of 37,000 characters, within every limit."""
    text = ("The quick brown fox jumps over the lazy dog. " * 900)[:37_000]
    return pb.RerankRequest(
        query="fox", candidates=[pb.Candidate(id=str(i), text=text) for i in range(100)]
    )


async def _peak_while(calls: Awaitable[list[str]], pid: int) -> tuple[float, float, list[str]]:
    """RSS before and at its peak while `calls` run, and their outcomes."""
    task = asyncio.ensure_future(calls)
    before = peak = rss_mib(pid)
    while not task.done():
        peak = max(peak, rss_mib(pid))
        await asyncio.sleep(0.02)
    return before, peak, await task


async def test_many_grpc_senders_of_valid_requests_stay_under_the_limit(
    fake_llama: FakeLlamaServer,
) -> None:
    """256 clients, each on its own connection, send a valid 3.7 MB request at once: the
    budget takes about 17, the rest are refused RESOURCE_EXHAUSTED with a retry hint
    before their messages are read. Peak RSS stays under the manifests' limit, whatever
    the number of senders; every admitted answer is complete."""
    raw = valid_request().SerializeToString()
    async with server_process(fake_llama.url, RERANK_PROBE="0") as (port, proc):
        # A channel of its own each: channels in one process otherwise share a connection.
        channels = [
            grpc.aio.insecure_channel(
                f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)]
            )
            for _ in range(SENDERS)
        ]
        try:
            await asyncio.gather(*(channel.channel_ready() for channel in channels))

            async def send(channel: grpc.aio.Channel) -> str:
                rerank = channel.unary_unary(  # the bytes as they are: encoded once
                    "/rerank.v1.Reranker/Rerank",
                    response_deserializer=pb.RerankResponse.FromString,
                )
                try:
                    answer = await rerank(raw, timeout=60)
                except grpc.aio.AioRpcError as exc:
                    hinted = RETRY_HINT in (exc.details() or "")
                    return f"{exc.code().name}{'' if hinted else ' without a retry hint'}"
                whole = sorted(int(r.id) for r in answer.results) == list(range(100))
                return "OK" if whole else f"OK with {len(answer.results)} results"

            before, peak, outcomes = await _peak_while(
                asyncio.gather(*(send(channel) for channel in channels)), proc.pid
            )
            alive = proc.poll() is None
        finally:
            await asyncio.gather(*(channel.close() for channel in channels))
    codes = Counter(outcomes)
    print(f"gRPC, {SENDERS} senders: {dict(codes)}, RSS {before:.0f} -> {peak:.0f} MiB")
    assert alive
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"} and codes["OK"] > 0, dict(codes)
    assert peak < MANIFEST_LIMIT_MIB and peak < _bound_mib(), f"peak {peak:.0f} MiB"


async def test_many_json_senders_of_valid_requests_stay_under_the_limit(
    fake_llama: FakeLlamaServer,
) -> None:
    """The same through the JSON API: 256 connections POST a valid 3.7 MB body at once;
    each is answered 200 with every result, or 429 / 503 with `Retry-After`, and peak
    RSS stays under the manifests' limit."""
    text = ("The quick brown fox jumps over the lazy dog. " * 900)[:37_000]
    body = json.dumps({"query": "fox", "documents": [text] * 100}).encode()
    http_port = free_port()
    limits = httpx.Limits(max_connections=SENDERS, max_keepalive_connections=SENDERS)
    async with (
        server_process(fake_llama.url, RERANK_PROBE="0", RERANK_HTTP_PORT=str(http_port)) as (
            _,
            proc,
        ),
        httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{http_port}", timeout=60, limits=limits
        ) as http,
    ):

        async def send() -> str:
            response = await http.post(
                "/v2/rerank", content=body, headers={"content-type": "application/json"}
            )
            if response.status_code != 200:
                hinted = "retry-after" in response.headers
                return f"{response.status_code}{'' if hinted else ' without Retry-After'}"
            indices = sorted(r["index"] for r in response.json()["results"])
            return "200" if indices == list(range(100)) else f"200 with {len(indices)} results"

        before, peak, outcomes = await _peak_while(
            asyncio.gather(*(send() for _ in range(SENDERS))), proc.pid
        )
        alive = proc.poll() is None
    codes = Counter(outcomes)
    print(f"JSON, {SENDERS} senders: {dict(codes)}, RSS {before:.0f} -> {peak:.0f} MiB")
    assert alive
    assert set(codes) <= {"200", "429", "503"} and codes["200"] > 0, dict(codes)
    assert peak < MANIFEST_LIMIT_MIB and peak < _bound_mib(), f"peak {peak:.0f} MiB"


FLOOD_CLIENTS, FLOOD_S = 16, 4.0


def maximal(kind: str) -> pb.RerankRequest:
    """About 4 MB, the default --max-message-bytes: valid, or refused for one oversized
    metadata value per candidate (INVALID_ARGUMENT)."""
    if kind == "refused":
        return pb.RerankRequest(
            query="q",
            candidates=[
                pb.Candidate(id=str(i), text="x", metadata={"k": "v" * 120_000}) for i in range(33)
            ],
        )
    return pb.RerankRequest(
        query="q", candidates=[pb.Candidate(id=str(i), text="word " * 22_000) for i in range(33)]
    )


def maximal_json(kind: str) -> bytes:
    """The same in the Cohere shape: refused for a query past its cap (422)."""
    if kind == "refused":
        return json.dumps(
            {"query": "q" * 120_000, "documents": [{"text": "x" * 120_000} for _ in range(33)]}
        ).encode()
    return json.dumps({"query": "q", "documents": ["word " * 22_000] * 33}).encode()


async def _flood(
    send: Callable[[], Awaitable[str]],
    pid: int,
) -> tuple[float, float, float, Counter[str]]:
    """`FLOOD_CLIENTS` sending back to back for `FLOOD_S`: RSS before, at its peak, and
    the lowest in the 3 s after, and the outcomes."""
    codes: Counter[str] = Counter()
    stop = time.monotonic() + FLOOD_S
    before = peak = rss_mib(pid)

    async def client() -> None:
        while time.monotonic() < stop:
            codes[await send()] += 1

    clients = asyncio.gather(*(client() for _ in range(FLOOD_CLIENTS)))
    while not clients.done():
        peak = max(peak, rss_mib(pid))
        await asyncio.sleep(0.1)
    await clients
    after = rss_mib(pid)
    for _ in range(30):
        await asyncio.sleep(0.1)
        after = min(after, rss_mib(pid))
    return before, peak, after, codes


def _bound_mib() -> float:
    """What the manifests are sized by (scripts/check_deploy.py), for the defaults."""
    return 1.25 * memory_estimate({}) / 2**20


@pytest.mark.parametrize("kind", ["refused", "valid"])
async def test_a_grpc_flood_of_maximal_messages_stays_bounded(
    fake_llama: FakeLlamaServer, kind: str
) -> None:
    request = maximal(kind)
    async with (
        server_process(fake_llama.url, RERANK_PROBE="0") as (port, proc),
        grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
    ):
        stub = pb_grpc.RerankerStub(channel)

        async def send() -> str:
            try:
                await stub.Rerank(request, timeout=60)
                return "OK"
            except grpc.aio.AioRpcError as exc:
                return exc.code().name

        before, peak, after, codes = await _flood(send, proc.pid)
    print(f"gRPC {kind}: {dict(codes)}, RSS {before:.0f} -> {peak:.0f} -> {after:.0f} MiB")
    assert (
        set(codes) <= ({"INVALID_ARGUMENT"} if kind == "refused" else {"OK", "RESOURCE_EXHAUSTED"})
        and codes
    ), dict(codes)
    assert peak < _bound_mib(), f"peak {peak:.0f} MiB"
    assert after < before + 100, f"{before:.0f} MiB before, {after:.0f} after"


@pytest.mark.parametrize("kind", ["refused", "valid"])
async def test_a_json_flood_of_maximal_bodies_stays_bounded(
    fake_llama: FakeLlamaServer, kind: str
) -> None:
    body, http_port = maximal_json(kind), free_port()
    async with (
        server_process(fake_llama.url, RERANK_PROBE="0", RERANK_HTTP_PORT=str(http_port)) as (
            _,
            proc,
        ),
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}", timeout=60) as http,
    ):

        async def send() -> str:
            response = await http.post(
                "/v2/rerank", content=body, headers={"content-type": "application/json"}
            )
            return str(response.status_code)

        before, peak, after, codes = await _flood(send, proc.pid)
    print(f"JSON {kind}: {dict(codes)}, RSS {before:.0f} -> {peak:.0f} -> {after:.0f} MiB")
    assert set(codes) <= ({"422"} if kind == "refused" else {"200", "429"}) and codes, dict(codes)
    assert peak < _bound_mib(), f"peak {peak:.0f} MiB"
    assert after < before + 100, f"{before:.0f} MiB before, {after:.0f} after"
