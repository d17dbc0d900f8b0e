"""RerankStream (ordered, early results) and RerankBatch (many requests, one stream)."""

from __future__ import annotations

import asyncio
import time

import grpc
from rerank_client import AsyncRerankClient, Candidate, InvalidRequestError, Result, Summary

from rerank_server.api.pb import rerank_pb2 as pb
from rerank_server.api.pb import rerank_pb2_grpc as pb_grpc
from rerank_server.server import RunningServer
from tests.fakes.llama import FakeLlamaServer
from tests.waiting import eventually

DOCS = [Candidate(id=f"d{i}", text=f"document {i}") for i in range(8)]


def _three_candidates(request_id: str) -> pb.RerankRequest:
    return pb.RerankRequest(
        request_id=request_id,
        query="q",
        candidates=[pb.Candidate(id=str(j), text=f"t{j}") for j in range(3)],
    )


async def test_stream_matches_unary_order(
    client: AsyncRerankClient, fake_llama: FakeLlamaServer
) -> None:
    fake_llama.scores = {
        f"document {i}": s for i, s in enumerate([0.2, 0.9, 0.4, 0.95, 0.1, 0.6, 0.3, 0.7])
    }
    unary = await client.rerank("q", DOCS)
    items = [x async for x in client.stream("q", DOCS)]
    results = [x for x in items if isinstance(x, Result)]
    assert isinstance(items[-1], Summary) and items[-1].reranked
    assert [r.id for r in results] == [r.id for r in unary.results]
    assert [r.rank for r in results] == list(range(1, 9))


async def test_stream_sends_first_result_before_scoring_ends(
    client: AsyncRerankClient, fake_llama: FakeLlamaServer
) -> None:
    """Rank 1's position is certain as soon as it beats every unscored bound (with a
    per-candidate blend; the request-wide ones wait for every score)."""
    fake_llama.scores = {"document 0": 0.99}
    # d0 answers at once; the others take long.
    fake_llama.latency_for = lambda doc: 0.0 if doc == "document 0" else 1.0
    started = time.perf_counter()
    first_at: float | None = None
    count = 0
    async for item in client.stream("q", DOCS[:4], blend_strategy="position_aware"):
        if isinstance(item, Result):
            if first_at is None:
                first_at = time.perf_counter() - started
                assert item.id == "d0"
            count += 1
    total = time.perf_counter() - started
    assert count == 4
    assert first_at is not None and first_at < 0.5 < total


async def test_stream_respects_top_k(client: AsyncRerankClient) -> None:
    items = [x async for x in client.stream("q", DOCS, top_k=3)]
    assert [x.rank for x in items if isinstance(x, Result)] == [1, 2, 3]
    assert isinstance(items[-1], Summary) and items[-1].candidates == 8


async def test_stream_invalid_request_is_invalid_argument(client: AsyncRerankClient) -> None:
    try:
        _ = [x async for x in client.stream("", DOCS)]
    except InvalidRequestError as exc:
        assert exc.message.startswith("query: ")
    else:
        raise AssertionError("expected InvalidRequestError")


async def test_batch_answers_each_request_matched_by_id(
    client: AsyncRerankClient, fake_llama: FakeLlamaServer
) -> None:
    fake_llama.latency_for = lambda doc: 0.4 if "slow" in doc else 0.0
    queries = {
        "slow": ("q1", ["slow a", "slow b", "slow c"]),
        "fast": ("q2", ["fast a", "fast b", "fast c"]),
        "bad": ("", ["x", "y", "z"]),
    }
    order: list[str] = []
    answers = {}
    async for request_id, answer in client.rerank_many(queries):
        order.append(request_id)
        answers[request_id] = answer
    assert set(answers) == {"slow", "fast", "bad"}
    assert order.index("fast") < order.index("slow")  # completion order, not request order
    assert isinstance(answers["bad"], InvalidRequestError)
    assert answers["bad"].message.startswith("query: ")
    assert answers["slow"].reranked and answers["fast"].reranked  # type: ignore[union-attr]


async def test_batch_of_many_requests_over_one_stream(server: RunningServer) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.RerankerStub(channel)

        async def requests():  # type: ignore[no-untyped-def]
            for i in range(20):
                yield _three_candidates(f"r{i}")
                await asyncio.sleep(0)

        ids = [r.request_id async for r in stub.RerankBatch(requests())]
    assert sorted(ids) == sorted(f"r{i}" for i in range(20))


async def test_a_batch_error_without_an_id_names_its_position(server: RunningServer) -> None:
    """An answer has only its request's id to be matched by; a refused request sent
    without one (or with one over its limit) says where it was in the stream, as one that
    did not decode always did."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.RerankerStub(channel)
        good = _three_candidates("ok")
        bad = pb.RerankRequest(query="", candidates=[pb.Candidate(id="0", text="t")])

        async def requests():  # type: ignore[no-untyped-def]
            for request in (good, bad):
                yield request

        answers = [r async for r in stub.RerankBatch(requests())]
    [refused] = [a for a in answers if a.HasField("error")]
    assert refused.request_id == ""
    assert refused.error.message.startswith("requests[1].query: ")


async def test_a_batch_stream_left_open_ends_when_the_server_stops(
    server: RunningServer, fake_llama: FakeLlamaServer
) -> None:
    """A client that keeps its RerankBatch stream open (more requests may come): on
    shutdown the server stops reading, answers the requests it has in full, and ends the
    stream UNAVAILABLE naming the first request it did not read. Before, the stream
    took requests until the grace period ran out, was cancelled with them, and held the
    shutdown for the whole grace period."""
    fake_llama.latency_s = 0.5
    more = asyncio.Event()  # never set: the client has nothing more to send yet
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.RerankerStub(channel)

        async def requests():  # type: ignore[no-untyped-def]
            for i in range(2):
                yield _three_candidates(f"r{i}")
            await more.wait()

        call = stub.RerankBatch(requests())
        answers = []

        async def read() -> None:
            async for answer in call:
                answers.append(answer)

        reading = asyncio.ensure_future(read())
        assert await eventually(lambda: fake_llama.in_flight >= 2, 5)
        started = time.monotonic()
        await server.stop(grace=10)
        stopped_in = time.monotonic() - started
        try:
            await reading
        except grpc.aio.AioRpcError as exc:
            code, details = exc.code(), exc.details() or ""
        else:
            raise AssertionError("the stream ended OK, with requests maybe unread")
    assert sorted(a.request_id for a in answers) == ["r0", "r1"]
    assert all(a.reranked and a.counts.scored == 3 and not a.HasField("degraded") for a in answers)
    assert code is grpc.StatusCode.UNAVAILABLE
    assert details.startswith("the server is shutting down: requests[2] and any after it")
    assert stopped_in < 3  # not the grace period's 10 s


async def test_a_batch_stream_opened_as_the_drain_begins_ends_unavailable(
    server: RunningServer,
) -> None:
    """A stream whose handler starts as shutdown begins is cut before it has read a
    thing: it must still end UNAVAILABLE naming `requests[0]` (the cut came before the
    feeder's first step, so it never took the cut in, and the call ended CANCELLED)."""
    assert server.edge.service is not None
    server.edge.service.drain()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.RerankerStub(channel)
        request = _three_candidates("r0")
        try:
            answers = [a async for a in stub.RerankBatch(iter([request]), timeout=10)]
        except grpc.aio.AioRpcError as exc:
            code, details = exc.code(), exc.details() or ""
        else:
            raise AssertionError(f"the stream ended OK, {len(answers)} answers")
    assert code is grpc.StatusCode.UNAVAILABLE
    assert details.startswith("the server is shutting down: requests[0] and any after it")
