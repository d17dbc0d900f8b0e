"""Per-token limits over real sockets (docs/security.md, "Per-token limits"): a token over
its rate, pairs or concurrency is refused on both edges with when to retry (JSON 429 and
`Retry-After`; gRPC RESOURCE_EXHAUSTED with `google.rpc.RetryInfo` and `retry-after-ms`)
while other tokens are served; places are given back however a call ends; a low-priority
flood leaves room for high-priority callers; health and metrics are never limited."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import grpc
import httpx
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from rerank_client import AsyncRerankClient, ServerBusyError
from rerank_client.types import build_request

from rerank_server.api.pb import rerank_pb2 as pb
from rerank_server.api.pb import rerank_pb2_grpc as pb_grpc
from rerank_server.errors import ConfigError
from rerank_server.managed.child_process import free_port
from rerank_server.server import RunningServer
from tests.conftest import StartServer
from tests.fakes.llama import FakeLlamaServer
from tests.waiting import eventually

TOKEN_A = "svc-a-token-0123456789"
TOKEN_B = "svc-b-token-0123456789"
TOKEN_C = "svc-c-token-0123456789"
DOCS = ["alpha", "beta", "gamma"]


async def limited_server(
    start_server: StartServer, tmp_path: Path, text: str, **settings: object
) -> RunningServer:
    path = tmp_path / "tokens"
    path.write_text(text)
    return await start_server(auth_tokens_file=str(path), http_port=free_port(), **settings)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def post(
    http: httpx.AsyncClient, server: RunningServer, token: str, docs: list[str] = DOCS
) -> httpx.Response:
    return await http.post(
        f"http://127.0.0.1:{server.http_port}/v1/rerank",
        json={"query": "q", "documents": docs},
        headers=bearer(token),
    )


async def call(
    channel: grpc.aio.Channel, token: str, docs: list[str] = DOCS, timeout: float = 10
) -> pb.RerankResponse:
    stub = pb_grpc.RerankerStub(channel)
    response: pb.RerankResponse = await stub.Rerank(
        build_request("q", docs), metadata=(("authorization", f"Bearer {token}"),), timeout=timeout
    )
    return response


def retry_seconds(error: grpc.aio.AioRpcError) -> tuple[int, str]:
    """The refusal's RetryInfo delay (through grpcio-status, which checks that the rich
    status matches the call's) and its plain `retry-after-ms`."""
    status = rpc_status.from_call(error)
    assert status is not None, "no google.rpc.Status in the trailers"
    [detail] = status.details
    info = error_details_pb2.RetryInfo()
    assert detail.Unpack(info)
    plain = dict(error.trailing_metadata() or ())["retry-after-ms"]
    return info.retry_delay.seconds, plain


async def admitted(channel: grpc.aio.Channel, token: str) -> bool:
    """Whether a call of `token` is admitted now (False: refused as over a limit)."""
    try:
        await call(channel, token, ["fresh"], timeout=5)
    except grpc.aio.AioRpcError as exc:
        assert exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, exc
        return False
    return True


def assert_429(answer: httpx.Response, names: str) -> None:
    assert answer.status_code == 429, answer.text
    assert int(answer.headers["Retry-After"]) >= 1
    assert names in answer.json()["message"]


async def test_a_token_over_its_rate_is_refused_on_both_edges_others_are_served(
    start_server: StartServer, tmp_path: Path
) -> None:
    """One budget over both edges: once svc-a's request is spent, its next is refused on
    JSON and on gRPC, each saying when to retry, while svc-b's requests, at the same
    time, are all answered."""
    server = await limited_server(
        start_server, tmp_path, f"{TOKEN_A} name=svc-a rps=1\n{TOKEN_B} name=svc-b\n"
    )
    async with (
        httpx.AsyncClient(timeout=10) as http,
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        assert (await post(http, server, TOKEN_A)).status_code == 200

        async def refused_on_grpc() -> grpc.aio.AioRpcError:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call(channel, TOKEN_A)
            return info.value

        refused_json, refused_grpc, *others = await asyncio.gather(
            post(http, server, TOKEN_A),
            refused_on_grpc(),
            *(post(http, server, TOKEN_B) for _ in range(5)),
            *(call(channel, TOKEN_B) for _ in range(5)),
        )
    message = "token 'svc-a' is over its limit of 1 requests per second; retry after 1 s"
    assert_429(refused_json, message)
    assert refused_json.headers["Retry-After"] == "1"
    assert refused_grpc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert refused_grpc.details() == message
    assert retry_seconds(refused_grpc) == (1, "1000")
    assert all(
        o.status_code == 200 if isinstance(o, httpx.Response) else o.reranked for o in others
    )


async def test_pairs_per_minute_refuse_the_request_that_would_pass_the_budget(
    start_server: StartServer, tmp_path: Path
) -> None:
    """A request's candidates as sent count: 2 + 2 of 5 pass, the next 2 would make 6 and
    are refused naming the limit and the request's pairs; in a RerankBatch stream the
    refused request is answered in the stream, which goes on."""
    server = await limited_server(
        start_server,
        tmp_path,
        f"{TOKEN_A} name=svc-json pairs_per_minute=5\n"
        f"{TOKEN_B} name=svc-grpc pairs_per_minute=5\n"
        f"{TOKEN_C} name=svc-batch pairs_per_minute=5\n",
    )
    two = DOCS[:2]
    async with httpx.AsyncClient(timeout=10) as http:
        assert (await post(http, server, TOKEN_A, two)).status_code == 200
        assert (await post(http, server, TOKEN_A, two)).status_code == 200
        assert_429(
            await post(http, server, TOKEN_A, two),
            "token 'svc-json' is over its limit of 5 pairs per minute (this request has 2)",
        )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        await call(channel, TOKEN_B, two)
        await call(channel, TOKEN_B, two)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call(channel, TOKEN_B, two)
    assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "token 'svc-grpc' is over its limit of 5 pairs per minute" in str(info.value.details())
    seconds, plain = retry_seconds(info.value)
    assert seconds >= 1 and plain == str(seconds * 1000)
    async with AsyncRerankClient(f"127.0.0.1:{server.port}", token=TOKEN_C) as client:
        answers = dict(
            [a async for a in client.rerank_many({f"r{i}": ("q", two) for i in range(3)})]
        )
    refused = [a for a in answers.values() if isinstance(a, ServerBusyError)]
    assert len(refused) == 1 and len(answers) == 3
    assert "svc-batch" in str(refused[0]) and "pairs per minute" in str(refused[0])


async def test_one_call_over_a_tokens_concurrency_is_refused_and_places_come_back(
    start_server: StartServer, fake_llama: FakeLlamaServer, tmp_path: Path
) -> None:
    """Three slow calls at once against `concurrent=2`: exactly one refused, on each edge;
    once they end, the places are free again. (Each call its own document: a cached
    score would answer at once.)"""
    fake_llama.latency_s = 1.0
    server = await limited_server(
        start_server, tmp_path, f"{TOKEN_A} name=svc-a concurrent=2\n", concurrency=8
    )
    async with httpx.AsyncClient(timeout=10) as http:
        answers = await asyncio.gather(*(post(http, server, TOKEN_A, [f"j{i}"]) for i in range(3)))
        assert sorted(a.status_code for a in answers) == [200, 200, 429]
        assert_429(
            next(a for a in answers if a.status_code == 429),
            "token 'svc-a' is over its limit of 2 concurrent requests; retry after 1 s",
        )
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            outcomes = await asyncio.gather(
                *(call(channel, TOKEN_A, [f"g{i}"]) for i in range(3)), return_exceptions=True
            )
            [refused] = [o for o in outcomes if isinstance(o, BaseException)]
            assert isinstance(refused, grpc.aio.AioRpcError)
            assert refused.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert retry_seconds(refused) == (1, "1000")
            fake_llama.latency_s = 0.0
            both = await asyncio.gather(
                post(http, server, TOKEN_A, ["j"]), call(channel, TOKEN_A, ["g"])
            )
    assert both[0].status_code == 200 and both[1].reranked


async def test_a_cancelled_call_gives_its_tokens_place_back(
    start_server: StartServer, fake_llama: FakeLlamaServer, tmp_path: Path
) -> None:
    """A gRPC client that cancels mid-request frees its token's one place at once, not
    when its backend call would have ended; a JSON client that hangs up frees it when its
    request's work ends (the JSON edge does not cancel that work)."""
    fake_llama.latency_s = 8.0
    server = await limited_server(
        start_server, tmp_path, f"{TOKEN_A} name=svc-a concurrent=1\n", concurrency=8
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.RerankerStub(channel)
        slow = stub.Rerank(
            build_request("q", DOCS[:1]), metadata=(("authorization", f"Bearer {TOKEN_A}"),)
        )
        assert await eventually(lambda: fake_llama.in_flight >= 1, 5)
        with pytest.raises(grpc.aio.AioRpcError) as busy:
            await call(channel, TOKEN_A, DOCS[:1])
        assert busy.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        slow.cancel()
        fake_llama.latency_s = 0.0

        assert await eventually(lambda: admitted(channel, TOKEN_A), 4, poll_s=0.1)
    fake_llama.latency_s = 1.5
    async with httpx.AsyncClient(timeout=10) as http:
        gone = asyncio.ensure_future(post(http, server, TOKEN_A, ["slow"]))
        assert await eventually(lambda: "slow" in fake_llama.documents(), 5)
        assert (await post(http, server, TOKEN_A, ["busy"])).status_code == 429
        gone.cancel()  # the connection closes: the client is gone
        fake_llama.latency_s = 0.0

        async def answered() -> bool:
            return (await post(http, server, TOKEN_A, ["later"])).status_code == 200

        assert await eventually(answered, 6, poll_s=0.1)


async def test_a_low_priority_flood_leaves_room_for_high_priority_callers(
    start_server: StartServer, fake_llama: FakeLlamaServer, tmp_path: Path
) -> None:
    """With --max-concurrent-rpcs 4, low-priority calls fill at most 2 places; the rest of
    the flood is shed naming the priority, and a high-priority call is still admitted."""
    fake_llama.latency_s = 1.5
    server = await limited_server(
        start_server,
        tmp_path,
        f"{TOKEN_A} name=batch-jobs priority=low\n{TOKEN_B} name=search priority=high\n",
        max_concurrent_rpcs=4,
        concurrency=8,
    )
    one = DOCS[:1]
    # Each its own passage: identical pairs in flight are sent once (single flight).
    own = [[f"flood passage {i}"] for i in range(12)]
    async with (
        httpx.AsyncClient(timeout=10) as http,
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        flood = [asyncio.ensure_future(call(channel, TOKEN_A, own[i])) for i in range(6)]
        flood_json = [
            asyncio.ensure_future(post(http, server, TOKEN_A, own[6 + i])) for i in range(6)
        ]
        assert await eventually(lambda: fake_llama.in_flight >= 4, 5)
        high, high_json = await asyncio.gather(
            call(channel, TOKEN_B, one), post(http, server, TOKEN_B, one)
        )
        outcomes = await asyncio.gather(*flood, return_exceptions=True)
        answers = await asyncio.gather(*flood_json)
    assert high.reranked and high_json.status_code == 200
    shed = [o for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
    assert len(shed) == 4 and all(
        e.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        and "all that low-priority callers may take of 4" in str(e.details())
        for e in shed
    )
    assert sorted(a.status_code for a in answers) == [200] * 2 + [429] * 4
    busy = re.compile(
        r"server busy: \d rerank requests in progress, all that low-priority callers may "
        r"take of 4 \(max_concurrent_rpcs\)"
    )
    assert all(busy.search(a.text) for a in answers if a.status_code == 429)


async def test_health_and_metrics_are_never_limited_and_refusals_are_counted(
    start_server: StartServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = await limited_server(start_server, tmp_path, f"{TOKEN_A} name=svc-a rps=1\n")
    async with httpx.AsyncClient(timeout=10) as http:
        await post(http, server, TOKEN_A)
        assert (await post(http, server, TOKEN_A)).status_code == 429
        for _ in range(5):
            health = await http.get(f"http://127.0.0.1:{server.http_port}/health")
            assert health.status_code == 200
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for _ in range(5):
                checked = await stub.Check(
                    health_pb2.HealthCheckRequest(service=""),
                    metadata=(("authorization", f"Bearer {TOKEN_A}"),),
                )
                assert checked.status == health_pb2.HealthCheckResponse.SERVING
        for _ in range(3):
            scraped = await http.get(f"http://127.0.0.1:{server.telemetry.metrics_port}/metrics")
            assert scraped.status_code == 200
    [sample] = [
        line for line in scraped.text.splitlines() if line.startswith("rerank_limit_refusals")
    ]
    assert 'rerank_token="svc-a"' in sample and 'rerank_limit="rps"' in sample
    assert sample.endswith(" 1.0")
    out = capsys.readouterr().out
    assert TOKEN_A not in out
    [refused] = [
        e
        for e in map(json.loads, (line for line in out.splitlines() if line.startswith("{")))
        if e["event"] == "rpc" and e.get("status") == "429"
    ]
    assert refused["token"] == "svc-a" and refused["limit"] == "rps"


async def test_a_bad_tokens_file_line_is_refused_at_start_naming_it(
    start_server: StartServer, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match=r"tokens line 2: rps must be a whole number") as info:
        await limited_server(
            start_server, tmp_path, f"{TOKEN_A} name=svc-a\n{TOKEN_B} name=svc-b rps=fast\n"
        )
    assert TOKEN_B not in str(info.value)
