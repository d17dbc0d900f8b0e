"""Per-token limits counted by replicas together in a real redis-server (--cache-url;
docs/security.md, "Per-token limits"): a token's rate, pairs and concurrency hold across
two servers and both edges, places come back however calls end, keys carry the prefix
and expire, and a Redis that dies lets requests through instead of refusing or holding
them up. Then the counter's scripts alone: fixed windows by Redis's clock, a request
larger than the limit alone in its window, give-backs that never go below zero."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import structlog.testing

from rerank_server.fleet.limit_counter import RedisLimitCounter
from rerank_server.managed.child_process import free_port
from rerank_server.server import RunningServer
from rerank_server.settings import Settings
from tests.conftest import StartServer
from tests.fakes.llama import FakeLlamaServer
from tests.fakes.redis_server import RedisServer, TlsTerminator
from tests.scraped import scrape, total
from tests.service.test_token_limits import (
    TOKEN_A,
    TOKEN_B,
    admitted,
    assert_429,
    call,
    post,
    retry_seconds,
)
from tests.waiting import eventually

# Loopback on a 2-core machine that may run other tests meanwhile.
MARGIN_S = 0.5


async def replicas(
    start_server: StartServer,
    tmp_path: Path,
    redis_server: RedisServer,
    tokens: str,
    **settings: Any,
) -> tuple[RunningServer, RunningServer]:
    """Two servers with the same tokens file and Redis (a generous bound by default:
    these tests are about counting, not about a loaded machine's first connect)."""
    path = tmp_path / "tokens"
    path.write_text(tokens)
    options: dict[str, Any] = {
        "auth_tokens_file": str(path),
        "cache_url": redis_server.url(),
        "cache_timeout_ms": 1000,
        **settings,
    }
    first = await start_server(http_port=free_port(), **options)
    second = await start_server(http_port=free_port(), **options)
    return first, second


def redis_ms(redis_server: RedisServer) -> int:
    seconds, micros = redis_server.inspect().time()
    return seconds * 1000 + micros // 1000


async def window_with(redis_server: RedisServer, window_s: float, needed_s: float) -> None:
    """Wait, if need be, until Redis's clock has `needed_s` left in its `window_s`
    window: a test's requests must not straddle two windows."""
    window_ms = round(window_s * 1000)
    left_ms = window_ms - redis_ms(redis_server) % window_ms
    if left_ms < needed_s * 1000:
        await asyncio.sleep(left_ms / 1000 + 0.01)


async def refused_on_grpc(
    channel: grpc.aio.Channel, token: str, docs: list[str]
) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call(channel, token, docs)
    assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, info.value
    return info.value


async def test_a_tokens_rate_is_shared_by_replicas_and_both_edges(
    start_server: StartServer, tmp_path: Path, redis_server: RedisServer
) -> None:
    """rps=2 over two replicas: one call on each is answered, the third is refused on
    either (JSON 429 on one, gRPC RESOURCE_EXHAUSTED on the other), while svc-b, counted
    in the same Redis, is served."""
    first, second = await replicas(
        start_server,
        tmp_path,
        redis_server,
        f"{TOKEN_A} name=svc-a rps=2\n{TOKEN_B} name=svc-b rps=1000\n",
    )
    async with (
        httpx.AsyncClient(timeout=10) as http,
        grpc.aio.insecure_channel(f"127.0.0.1:{second.port}") as channel,
    ):
        # Connected to both, and to Redis, before the window starts.
        assert (await post(http, first, TOKEN_B)).status_code == 200
        assert (await call(channel, TOKEN_B)).reranked
        await window_with(redis_server, 1.0, 0.8)
        assert (await post(http, first, TOKEN_A)).status_code == 200
        assert (await call(channel, TOKEN_A)).reranked
        refused_json, refused_grpc, *others = await asyncio.gather(
            post(http, first, TOKEN_A),
            refused_on_grpc(channel, TOKEN_A, ["alpha"]),
            *(post(http, first, TOKEN_B) for _ in range(3)),
            *(call(channel, TOKEN_B) for _ in range(3)),
        )
    message = "token 'svc-a' is over its limit of 2 requests per second; retry after 1 s"
    assert_429(refused_json, message)
    assert refused_json.headers["Retry-After"] == "1"
    assert refused_grpc.details() == message
    assert retry_seconds(refused_grpc) == (1, "1000")
    assert all(
        o.status_code == 200 if isinstance(o, httpx.Response) else o.reranked for o in others
    )


async def test_a_tokens_pairs_per_minute_are_shared_by_replicas(
    start_server: StartServer, tmp_path: Path, redis_server: RedisServer
) -> None:
    """pairs_per_minute=5: 2 pairs on one replica and 2 on the other pass; 2 more are
    refused on either, naming the request's pairs; the last 1 still passes."""
    first, second = await replicas(
        start_server, tmp_path, redis_server, f"{TOKEN_A} name=svc-a pairs_per_minute=5\n"
    )
    async with (
        httpx.AsyncClient(timeout=10) as http,
        grpc.aio.insecure_channel(f"127.0.0.1:{second.port}") as channel,
    ):
        await window_with(redis_server, 60.0, 10.0)
        assert (await post(http, first, TOKEN_A, ["a", "b"])).status_code == 200
        assert (await call(channel, TOKEN_A, ["c", "d"])).reranked
        assert_429(
            await post(http, first, TOKEN_A, ["e", "f"]),
            "token 'svc-a' is over its limit of 5 pairs per minute (this request has 2)",
        )
        refused = await refused_on_grpc(channel, TOKEN_A, ["g", "h"])
        assert "over its limit of 5 pairs per minute (this request has 2)" in str(refused.details())
        seconds, plain = retry_seconds(refused)
        assert 1 <= seconds <= 60 and plain == str(seconds * 1000)
        assert (await call(channel, TOKEN_A, ["i"])).reranked


async def test_concurrency_is_shared_and_places_come_back_after_answers_and_cancels(
    start_server: StartServer,
    fake_llama: FakeLlamaServer,
    tmp_path: Path,
    redis_server: RedisServer,
) -> None:
    """concurrent=2: three slow calls over two replicas, exactly one refused; once they
    are answered the places are free in Redis. Then concurrent=1 held by a gRPC call on
    one replica refuses a call on the other until that call is cancelled. (Each call its
    own documents: a cached score would answer at once.)"""
    fake_llama.latency_s = 1.0
    first, second = await replicas(
        start_server,
        tmp_path,
        redis_server,
        f"{TOKEN_A} name=svc-a concurrent=2\n{TOKEN_B} name=svc-b concurrent=1\n",
        concurrency=8,
    )
    inspect = redis_server.inspect()
    async with (
        httpx.AsyncClient(timeout=10) as http,
        grpc.aio.insecure_channel(f"127.0.0.1:{first.port}") as on_first,
        grpc.aio.insecure_channel(f"127.0.0.1:{second.port}") as on_second,
    ):
        outcomes = await asyncio.gather(
            post(http, first, TOKEN_A, ["j0"]),
            post(http, first, TOKEN_A, ["j1"]),
            call(on_second, TOKEN_A, ["g0"]),
            return_exceptions=True,
        )
        refused = [
            o
            for o in outcomes
            if isinstance(o, grpc.aio.AioRpcError)
            or (isinstance(o, httpx.Response) and o.status_code != 200)
        ]
        assert len(refused) == 1, outcomes
        [one] = refused
        if isinstance(one, httpx.Response):
            assert_429(one, "token 'svc-a' is over its limit of 2 concurrent requests")
        else:
            assert one.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert await eventually(lambda: not inspect.exists("rerank:limit:svc-a:concurrent"), 5)
        fake_llama.latency_s = 0.0
        both = await asyncio.gather(
            post(http, first, TOKEN_A, ["j2"]), call(on_second, TOKEN_A, ["g1"])
        )
        assert both[0].status_code == 200 and both[1].reranked

        fake_llama.latency_s = 8.0
        slow = asyncio.ensure_future(call(on_first, TOKEN_B, ["slow"], timeout=20))
        assert await eventually(lambda: fake_llama.in_flight >= 1, 5)
        await refused_on_grpc(on_second, TOKEN_B, ["busy"])
        assert_429(await post(http, second, TOKEN_B, ["busy"]), "svc-b")
        slow.cancel()
        fake_llama.latency_s = 0.0

        assert await eventually(lambda: admitted(on_second, TOKEN_B), 4, poll_s=0.1)


async def test_keys_carry_the_prefix_and_expire(
    start_server: StartServer,
    fake_llama: FakeLlamaServer,
    tmp_path: Path,
    redis_server: RedisServer,
) -> None:
    """Every limit's key is `--cache-key-prefix` + `limit:` + the token's name and limit
    (+ the window), never the token, and each has an expiry: a window's just past its
    end, a place's its lease."""
    fake_llama.latency_s = 1.0
    first, _ = await replicas(
        start_server,
        tmp_path,
        redis_server,
        f"{TOKEN_A} name=svc-a rps=5 pairs_per_minute=100 concurrent=3\n",
        cache_key_prefix="team-a:",
    )
    inspect = redis_server.inspect()
    async with httpx.AsyncClient(timeout=10) as http:
        pending = asyncio.ensure_future(post(http, first, TOKEN_A))
        assert await eventually(lambda: fake_llama.in_flight >= 1, 5)
        keys = {k.decode(): inspect.pttl(k) for k in inspect.scan_iter("team-a:limit:*")}
        assert (await pending).status_code == 200
    by_kind = {key.split(":")[3]: (key, pttl) for key, pttl in keys.items()}
    assert sorted(by_kind) == ["concurrent", "pairs_per_minute", "rps"], keys
    assert by_kind["concurrent"][0] == "team-a:limit:svc-a:concurrent"
    assert 0 < by_kind["concurrent"][1] <= 60_000
    rps_key, rps_ttl = by_kind["rps"]
    assert rps_key.startswith("team-a:limit:svc-a:rps:") and 0 < rps_ttl <= 2_000
    pairs_key, pairs_ttl = by_kind["pairs_per_minute"]
    assert pairs_key.startswith("team-a:limit:svc-a:pairs_per_minute:")
    assert 0 < pairs_ttl <= 61_000
    assert all(TOKEN_A not in key for key in keys)
    assert await eventually(lambda: not inspect.exists("team-a:limit:svc-a:concurrent"), 5)


async def test_redis_killed_lets_requests_through_unslowed_with_one_log_line(
    start_server: StartServer, tmp_path: Path, redis_server: RedisServer
) -> None:
    """Once Redis is gone, a token over every limit is still answered, each request
    within the bound, not refused; the counter logs `limit_counter_down` once and counts
    what it let through."""
    first, _ = await replicas(
        start_server,
        tmp_path,
        redis_server,
        f"{TOKEN_A} name=svc-a rps=1 pairs_per_minute=3 concurrent=1\n",
        cache_timeout_ms=100,
    )
    async with httpx.AsyncClient(timeout=10) as http:
        assert (await post(http, first, TOKEN_A)).status_code == 200  # connected
        redis_server.kill()
        with structlog.testing.capture_logs() as logged:
            timings = []
            for i in range(8):
                started = time.perf_counter()
                answer = await post(http, first, TOKEN_A, [f"doc {i}", "x", "y"])
                timings.append(time.perf_counter() - started)
                assert answer.status_code == 200, answer.text
            together = await asyncio.gather(*(post(http, first, TOKEN_A) for _ in range(4)))
    assert all(a.status_code == 200 for a in together)
    # Three calls a request (place, rate, pairs), each waited for at most the bound.
    assert max(timings) < 3 * 0.1 + MARGIN_S
    events = [
        (e["event"], e.get("error")) for e in logged if e["event"].startswith("limit_counter")
    ]
    assert events == [("limit_counter_down", "connection")]
    assert total(await scrape(first), "rerank_limit_counter_errors_total") >= 8


# --- the counter alone, against the real Redis


@pytest.fixture
async def counter(redis_server: RedisServer) -> AsyncIterator[RedisLimitCounter]:
    settings = Settings(cache_url=redis_server.url(), cache_timeout_ms=1000)
    made = RedisLimitCounter.from_settings(settings)
    yield made
    await made.aclose()


async def test_a_window_counts_up_to_the_limit_then_says_what_is_left_of_it(
    counter: RedisLimitCounter, redis_server: RedisServer
) -> None:
    """Fixed windows of Redis's clock: 2 of 2 counted, the third refused for what is left
    of the window (nothing counted), counted again in the next window."""
    await window_with(redis_server, 0.5, 0.4)
    assert await counter.take("svc:rps", 1, 2, 0.5) == 0.0
    assert await counter.take("svc:rps", 1, 2, 0.5) == 0.0
    wait = await counter.take("svc:rps", 1, 2, 0.5)
    assert 0.0 < wait <= 0.5
    [key] = redis_server.inspect().keys("rerank:limit:svc:rps:*")
    assert redis_server.inspect().get(key) == b"2"
    await asyncio.sleep(wait + 0.01)
    assert await counter.take("svc:rps", 1, 2, 0.5) == 0.0
    assert len(redis_server.inspect().keys("rerank:limit:svc:rps:*")) == 2


async def test_an_amount_over_the_limit_passes_alone_in_its_window_only(
    counter: RedisLimitCounter, redis_server: RedisServer
) -> None:
    """An amount over the limit is counted when nothing else is in the window (it passes
    rather than never); after it, and after anything else, it is refused uncounted."""
    await window_with(redis_server, 60.0, 10.0)
    assert await counter.take("big:pairs_per_minute", 7, 5, 60.0) == 0.0
    assert await counter.take("big:pairs_per_minute", 1, 5, 60.0) > 0.0
    assert await counter.take("other:pairs_per_minute", 1, 5, 60.0) == 0.0
    wait = await counter.take("other:pairs_per_minute", 7, 5, 60.0)
    assert 0.0 < wait <= 60.0
    [key] = redis_server.inspect().keys("rerank:limit:other:pairs_per_minute:*")
    assert redis_server.inspect().get(key) == b"1"


async def test_places_are_leased_given_back_and_never_below_zero(
    counter: RedisLimitCounter, redis_server: RedisServer
) -> None:
    inspect = redis_server.inspect()
    key = "rerank:limit:svc:concurrent"
    assert await counter.enter("svc:concurrent", 2)
    assert await counter.enter("svc:concurrent", 2)
    assert not await counter.enter("svc:concurrent", 2)
    assert inspect.zcard(key) == 2 and 0 < inspect.pttl(key) <= 60_000
    counter.leave("svc:concurrent")
    await counter.flush()
    assert inspect.zcard(key) == 1
    for _ in range(3):  # two more than are held
        counter.leave("svc:concurrent")
    await counter.flush()
    assert not inspect.exists(key)
    assert await counter.enter("svc:concurrent", 1)
    assert inspect.zcard(key) == 1


async def test_a_dead_replicas_places_free_up_a_lease_later_however_busy_the_token(
    redis_server: RedisServer,
) -> None:
    """concurrent=3, two places held by a replica that died: another, whose calls take
    the third place and give it back without pause, has all three a lease later."""
    settings = Settings(cache_url=redis_server.url(), cache_timeout_ms=1000)
    dead, alive = (RedisLimitCounter.from_settings(settings) for _ in range(2))
    lease_s = 0.5
    dead._lease_ms = alive._lease_ms = round(lease_s * 1000)  # a minute, in production
    try:
        assert await dead.enter("svc:concurrent", 3)
        assert await dead.enter("svc:concurrent", 3)
        started = time.monotonic()
        while time.monotonic() - started < 3 * lease_s:
            assert await alive.enter("svc:concurrent", 3)
            alive.leave("svc:concurrent")
            await alive.flush()
            await asyncio.sleep(0.02)
        assert all([await alive.enter("svc:concurrent", 3) for _ in range(3)])
    finally:
        await dead.aclose()
        await alive.aclose()


async def test_a_hung_redis_fails_open_within_the_bound_and_late_places_come_back(
    redis_server: RedisServer,
) -> None:
    """Redis paused: `take` and `enter` answer as if under the limit after the bound. The
    place Redis gives once it wakes, nobody waiting for it, is given back; the caller's
    `leave` of the place it entered without Redis sends nothing (the other holder's
    place stays counted)."""
    settings = Settings(cache_url=redis_server.url(), cache_timeout_ms=50)
    counter = RedisLimitCounter.from_settings(settings)
    inspect = redis_server.inspect()
    key = "rerank:limit:svc:concurrent"
    try:
        assert await counter.enter("svc:concurrent", 2)  # connected; another holder
        redis_server.pause()
        try:
            started = time.perf_counter()
            assert await counter.enter("svc:concurrent", 2)
            assert await counter.take("svc:rps", 1, 1, 1.0) == 0.0
            assert time.perf_counter() - started < 2 * 0.05 + MARGIN_S
        finally:
            redis_server.resume()
        # The late calls ended (they run on past the bound, within the socket timeout).
        assert await eventually(lambda: not counter.link._running, 3)
        assert inspect.zcard(key) == 1  # entered late, given back at once
        counter.leave("svc:concurrent")  # the one entered without Redis
        await counter.flush()
        assert inspect.zcard(key) == 1
        assert counter.link.breaker.up  # two slow calls do not open it
    finally:
        await counter.aclose()


async def test_a_cancelled_enter_gives_back_the_place_redis_gave_it(
    redis_server: RedisServer,
) -> None:
    settings = Settings(cache_url=redis_server.url(), cache_timeout_ms=1000)
    counter = RedisLimitCounter.from_settings(settings)
    inspect = redis_server.inspect()
    try:
        assert await counter.take("warm:rps", 1, 10, 1.0) == 0.0  # connected
        redis_server.pause()
        try:
            entering = asyncio.ensure_future(counter.enter("svc:concurrent", 1))
            await asyncio.sleep(0.1)
            entering.cancel()
            with pytest.raises(asyncio.CancelledError):
                await entering
        finally:
            redis_server.resume()
        assert await eventually(lambda: not counter.link._running, 3)
        assert not inspect.exists("rerank:limit:svc:concurrent")
    finally:
        await counter.aclose()


async def test_the_json_cap_holds_while_pairs_are_charged_in_a_slow_redis(
    start_server: StartServer,
    fake_llama: FakeLlamaServer,
    tmp_path: Path,
    redis_server: RedisServer,
) -> None:
    """--max-concurrent-rpcs 1 and four JSON requests at once, whose pairs are charged in
    a Redis that answers 0.1 s late: one is served, three are shed as busy (a place
    free when the body was in is taken before the charge, not after it)."""
    slow = await TlsTerminator(redis_server.port, None, delay_s=0.1).start()
    try:
        path = tmp_path / "tokens"
        path.write_text(f"{TOKEN_A} name=svc-a pairs_per_minute=100000\n")
        server = await start_server(
            http_port=free_port(),
            auth_tokens_file=str(path),
            cache_url=f"redis://127.0.0.1:{slow.port}/0",
            cache_timeout_ms=2000,
            max_concurrent_rpcs=1,
        )
        fake_llama.latency_s = 0.5
        async with httpx.AsyncClient(timeout=10) as http:
            answers = await asyncio.gather(
                *(post(http, server, TOKEN_A, [f"passage {i}"]) for i in range(4))
            )
    finally:
        await slow.stop()
    assert sorted(a.status_code for a in answers) == [200, 429, 429, 429]
    assert all("server busy" in a.text for a in answers if a.status_code == 429)
