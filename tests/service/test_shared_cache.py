"""The shared score cache (--cache-url) against a real redis-server started here:
replicas answer what another scored, nothing but digests and scores reach Redis, and a
Redis that dies, hangs, refuses or is full never fails a request nor holds it up longer
than --cache-timeout-ms."""

from __future__ import annotations

import asyncio
import dataclasses
import ssl
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import structlog.testing
import trustme
from rerank_client import AsyncRerankClient, RerankAnswer

from rerank_server.errors import ConfigError
from rerank_server.fleet import redis_client, shared_cache
from rerank_server.fleet.redis_client import Breaker, RedisLink
from rerank_server.fleet.shared_cache import RedisScoreTier
from rerank_server.ranking.score_cache import ScoreCache
from rerank_server.server import RunningServer, build_server
from rerank_server.settings import Settings
from tests.conftest import StartServer, client_of
from tests.fakes.llama import FakeLlamaServer
from tests.fakes.redis_server import RedisServer, TlsTerminator
from tests.scraped import scrape, total
from tests.waiting import eventually

DOCS = ["apples are red", "bananas are yellow", "cherries are dark"]
CANARY = "CANARY-5e1f"
# Loopback on a 2-core machine that may run other tests meanwhile: a request's own work
# is milliseconds, this is what it may add on a bad moment.
MARGIN_S = 0.5
READS = "rerank_cache_shared_duration_seconds_count"


async def replica(start_server: StartServer, **overrides: Any) -> RunningServer:
    """A server started with `overrides`, once it knows its backend's model: scores are
    keyed by it, and a first request before the backend's /v1/models was read would
    look up the scores another replica stored under the model's name."""
    server = await start_server(**overrides)
    assert await eventually(lambda: bool(server.reranker.scorer.model), timeout_s=5)
    return server


def tier_of(server: RunningServer) -> RedisScoreTier:
    shared = server.reranker.cache.shared
    assert isinstance(shared, RedisScoreTier)
    return shared


async def rerank(server: RunningServer, query: str, docs: list[str]) -> RerankAnswer:
    async with client_of(server) as client:
        return await client.rerank(query, docs)


async def timed(client: AsyncRerankClient, query: str) -> tuple[float, RerankAnswer]:
    started = time.perf_counter()
    answer = await client.rerank(query, DOCS)
    return time.perf_counter() - started, answer


async def test_a_replica_answers_what_another_scored_without_the_backend(
    start_server: StartServer, fake_llama: FakeLlamaServer, redis_server: RedisServer
) -> None:
    # A generous bound: this is about sharing, not about a loaded machine's first connect.
    first = await replica(start_server, cache_url=redis_server.url(), cache_timeout_ms=1000)
    second = await replica(start_server, cache_url=redis_server.url(), cache_timeout_ms=1000)
    fake_llama.scores = {"bananas": 0.9, "cherries": 0.6}
    scored = await rerank(first, "fruit", DOCS)
    await tier_of(first).flush()
    calls = len(fake_llama.requests)

    answered = await rerank(second, "fruit", DOCS)
    assert len(fake_llama.requests) == calls == 3
    assert answered.summary.cached == 3 and all(r.cached for r in answered.results)
    assert [(r.id, r.score) for r in answered.results] == [(r.id, r.score) for r in scored.results]
    # Remembered in the second's memory: asked again, Redis is not.
    asked = tier_of(second).asked
    assert (await rerank(second, "fruit", DOCS)).summary.cached == 3
    assert tier_of(second).asked == asked

    found = await scrape(second)
    lookups = "rerank_cache_lookups_total"
    assert total(found, lookups, rerank_cache_result="hit", rerank_cache_tier="shared") == 3
    assert total(found, lookups, rerank_cache_result="hit", rerank_cache_tier="memory") == 3
    assert total(found, READS, error_type="") == 1


async def test_keys_are_digests_under_the_prefix_values_scores_each_with_the_ttl(
    start_server: StartServer, fake_llama: FakeLlamaServer, redis_server: RedisServer
) -> None:
    server = await replica(
        start_server,
        cache_url=redis_server.url(),
        cache_timeout_ms=1000,
        cache_key_prefix="team-a:",
        cache_ttl_s=120,
    )
    fake_llama.scores = {"bananas": 0.9, "cherries": 0.6}
    docs = [f"{doc} {CANARY}" for doc in DOCS]
    await rerank(server, f"fruit {CANARY}", docs)
    await tier_of(server).flush()

    inspect = redis_server.inspect()
    keys = list(inspect.scan_iter(count=1000))
    assert len(keys) == 3
    text = [CANARY, "fruit", *DOCS]
    for key in keys:
        assert key.startswith(b"team-a:") and len(key) == len(b"team-a:") + 32
        value = inspect.get(key)
        assert value is not None and 0.0 <= float(value) <= 1.0
        for part in text:
            assert part.encode() not in key and part.encode() not in value
        assert 0 < inspect.pttl(key) <= 120_000
    stored = sorted(float(inspect.get(k) or b"") for k in keys)
    assert stored == pytest.approx([0.5, 0.6, 0.9], abs=1e-3)


async def test_a_password_and_an_acl_user_are_sent_and_a_wrong_password_fails_open(
    start_server: StartServer, fake_llama: FakeLlamaServer
) -> None:
    redis_server = RedisServer(password="s3cret", users={"alice": "alices"}).start()
    try:
        by_password = await replica(
            start_server, cache_url=redis_server.url(), cache_timeout_ms=1000
        )
        await rerank(by_password, "fruit", DOCS)
        await tier_of(by_password).flush()
        as_alice = await replica(
            start_server,
            cache_url=redis_server.url(user="alice", password="alices"),
            cache_timeout_ms=1000,
        )
        assert (await rerank(as_alice, "fruit", DOCS)).summary.cached == 3

        wrong = await replica(
            start_server, cache_url=redis_server.url(password="guessed"), cache_timeout_ms=1000
        )
        with structlog.testing.capture_logs() as logged:
            for i in range(6):
                answer = await rerank(wrong, f"query {i}", DOCS)
                assert answer.reranked and answer.summary.cached == 0
        shared = [e for e in logged if e["event"].startswith("score_cache_shared")]
        assert [(e["event"], e["error"], e["error_type"]) for e in shared] == [
            ("score_cache_shared_down", "refused", "AuthenticationError")
        ]
        assert not tier_of(wrong).link.breaker.up and tier_of(wrong).asked <= 3  # of 6
    finally:
        redis_server.stop()


@pytest.fixture
async def tls_redis(redis_server: RedisServer, tmp_path: Path) -> AsyncIterator[tuple[str, Path]]:
    """A rediss:// URL in front of `redis_server`, and the CA file that signed it."""
    ca = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1", "localhost").configure_cert(context)
    ca_path = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_path))
    terminator = await TlsTerminator(redis_server.port, context).start()
    yield f"rediss://127.0.0.1:{terminator.port}/0", ca_path
    await terminator.stop()


async def test_rediss_with_the_ca_shares_and_without_it_fails_open(
    start_server: StartServer,
    fake_llama: FakeLlamaServer,
    redis_server: RedisServer,
    tls_redis: tuple[str, Path],
) -> None:
    url, ca = tls_redis
    first = await replica(start_server, cache_url=url, cache_tls_ca=str(ca), cache_timeout_ms=1000)
    second = await replica(start_server, cache_url=url, cache_tls_ca=str(ca), cache_timeout_ms=1000)
    await rerank(first, "fruit", DOCS)
    await tier_of(first).flush()
    assert (await rerank(second, "fruit", DOCS)).summary.cached == 3
    assert len(redis_server.inspect().keys()) == 3

    untrusting = await replica(start_server, cache_url=url, cache_timeout_ms=1000)  # system CAs
    for i in range(4):
        assert (await rerank(untrusting, f"query {i}", DOCS)).reranked
    assert not tier_of(untrusting).link.breaker.up


async def test_redis_killed_under_load_fails_no_request_and_is_asked_no_more(
    start_server: StartServer, fake_llama: FakeLlamaServer, redis_server: RedisServer
) -> None:
    server = await replica(start_server, cache_url=redis_server.url(), cache_timeout_ms=20)
    tier = tier_of(server)
    await rerank(server, "warm up", DOCS)  # connected
    fake_llama.latency_s = 0.01

    async with client_of(server) as client:

        async def wave(n: int) -> list[tuple[float, RerankAnswer]]:
            return await asyncio.gather(*(timed(client, f"wave {n} query {i}") for i in range(20)))

        async def kill_soon() -> None:
            await asyncio.sleep(0.05)
            redis_server.kill()

        with structlog.testing.capture_logs() as logged:
            waves = await asyncio.gather(wave(0), kill_soon())
            answers = [*waves[0], *await wave(1), *await wave(2)]
            assert not tier.link.breaker.up
            asked = tier.asked
            answers += await wave(3)
        assert tier.asked == asked  # the breaker: not asked while down

    assert all(a.reranked and a.summary.failed == 0 for _, a in answers)
    # Twenty requests of three pairs share four backend slots: 15 calls deep.
    assert max(s for s, _ in answers) < 60 / 4 * fake_llama.latency_s + MARGIN_S
    found, buckets = await scrape(server), "rerank_cache_shared_duration_seconds_bucket"
    assert total(found, buckets, le="+Inf") == total(found, buckets, le="0.25")  # none longer
    downs = [e for e in logged if e["event"] == "score_cache_shared_down"]
    # Logged once, however the first failure showed: a read in flight at the kill may
    # reach its bound before the loop sees the reset on a loaded machine.
    assert len(downs) == 1 and downs[0]["error"] in {"connection", "timeout"}


async def test_a_hung_redis_delays_a_request_no_more_than_the_timeout_then_comes_back(
    start_server: StartServer, fake_llama: FakeLlamaServer, redis_server: RedisServer
) -> None:
    server = await replica(start_server, cache_url=redis_server.url(), cache_timeout_ms=20)
    tier = tier_of(server)
    await rerank(server, "warm up", DOCS)
    redis_server.pause()
    try:
        with structlog.testing.capture_logs() as logged:
            async with client_of(server) as client:
                took = [await timed(client, f"query {i}") for i in range(6)]
        # A read waited on would take the socket timeout (1 s).
        assert all(s < 0.02 + MARGIN_S and a.reranked for s, a in took)
        assert not tier.link.breaker.up and tier.asked == 1 + 3
    finally:
        redis_server.resume()
    assert total(await scrape(server), READS, error_type="timeout") == 3

    # Back: a lookup after the back-off starts a probe, and the next reads are answered.
    await asyncio.sleep(redis_client.FIRST_BACKOFF_S)
    with structlog.testing.capture_logs() as back:
        assert await eventually(lambda: tier.link.usable(), timeout_s=5)
    await rerank(server, "query 0", DOCS)  # in memory: not asked
    answer = await rerank(server, "a new query", DOCS)
    assert answer.reranked and tier.asked == 5
    events = [e["event"] for e in [*logged, *back] if e["event"].startswith("score_cache_shared")]
    assert events == ["score_cache_shared_down", "score_cache_shared_up"]


async def test_a_slow_redis_delays_a_request_no_more_than_the_timeout(
    start_server: StartServer, fake_llama: FakeLlamaServer, redis_server: RedisServer
) -> None:
    """Redis answering, but 0.8 s late (a loopback proxy): each request waits for it at
    most --cache-timeout-ms (20 ms), is scored and answered; after three late reads the
    server stops asking."""
    slow = await TlsTerminator(redis_server.port, None, delay_s=0.8).start()
    try:
        server = await replica(
            start_server, cache_url=f"redis://127.0.0.1:{slow.port}/0", cache_timeout_ms=20
        )
        tier = tier_of(server)
        async with client_of(server) as client:
            took = [await timed(client, f"slow {i}") for i in range(6)]
        assert all(s < 0.02 + MARGIN_S and a.reranked for s, a in took)
        assert not tier.link.breaker.up and tier.asked == 3
        assert total(await scrape(server), READS, error_type="timeout") == 3
    finally:
        await slow.stop()


async def test_a_full_redis_refuses_the_writes_and_still_answers_the_reads(
    start_server: StartServer, fake_llama: FakeLlamaServer, redis_server: RedisServer
) -> None:
    server = await replica(start_server, cache_url=redis_server.url(), cache_timeout_ms=1000)
    await rerank(server, "fruit", DOCS)
    await tier_of(server).flush()
    inspect = redis_server.inspect()
    inspect.config_set("maxmemory", 1)  # noeviction: every write is OOM
    other = await replica(start_server, cache_url=redis_server.url(), cache_timeout_ms=1000)
    with structlog.testing.capture_logs() as logged:
        for i in range(3):
            assert (await rerank(server, f"new {i}", DOCS)).reranked
            await tier_of(server).flush()
        assert (await rerank(other, "fruit", DOCS)).summary.cached == 3
    refused = [e for e in logged if e["event"] == "score_cache_shared_error"]
    assert [e["error"] for e in refused] == ["refused"] and "OOM" in refused[0]["detail"]
    assert tier_of(server).link.breaker.up
    assert len(inspect.keys()) == 3


async def test_a_user_refused_scripts_writes_with_plain_sets(
    start_server: StartServer, fake_llama: FakeLlamaServer
) -> None:
    redis_server = RedisServer(
        password="s3cret", users={"bob": "bobs"}, denied={"bob": ["-@scripting"]}
    ).start()
    try:
        url = redis_server.url(user="bob", password="bobs")
        first = await replica(start_server, cache_url=url, cache_timeout_ms=1000)
        with structlog.testing.capture_logs() as logged:
            for query in ("fruit", "vegetables"):
                await rerank(first, query, DOCS)
                await tier_of(first).flush()
        second = await replica(start_server, cache_url=url, cache_timeout_ms=1000)
        assert (await rerank(second, "fruit", DOCS)).summary.cached == 3
        assert (await rerank(second, "vegetables", DOCS)).summary.cached == 3
        events = [e["event"] for e in logged if e["event"].startswith("score_cache_shared")]
        assert events == ["score_cache_shared_no_scripts"]
        inspect = redis_server.inspect()
        keys = list(inspect.scan_iter())
        assert len(keys) == 6 and all(0 < inspect.pttl(key) <= 3_600_000 for key in keys)
    finally:
        redis_server.stop()


async def test_a_cache_url_that_cannot_work_stops_the_start(
    fake_llama: FakeLlamaServer, tmp_path: Path
) -> None:
    base = Settings(port=0, backend_url=fake_llama.url, probe=False, http_port=0, metrics_port=0)
    for overrides, words in [
        ({"cache_url": "http://user:pw@127.0.0.1:6379"}, "--cache-url"),
        ({"cache_url": "redis://:pw@127.0.0.1:port/0"}, "--cache-url"),
        ({"cache_url": "redis://:pw@127.0.0.1:6379", "cache_tls_ca": "ca.pem"}, "rediss://"),
        ({"cache_url": "rediss://:pw@h:6379", "cache_tls_ca": str(tmp_path / "no")}, "no file"),
    ]:
        with pytest.raises(ConfigError, match=words) as raised:
            await build_server(dataclasses.replace(base, **overrides))
        assert "pw" not in str(raised.value)


async def test_reads_in_flight_and_scores_queued_are_bounded(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hung Redis holds at most MAX_PENDING_READS reads (then a lookup is a miss at
    once, not a connection more) and MAX_QUEUED_SCORES scores (then a request's are
    left out, counted, logged once)."""
    monkeypatch.setattr(shared_cache, "MAX_QUEUED_SCORES", 100)
    settings = Settings(cache_url=redis_server.url(), cache_timeout_ms=20)
    tier = RedisScoreTier.from_settings(settings)
    tier.link = RedisLink(tier.link.client, tier.link.breaker, lambda r: r.ping(), max_reads=2)
    keys = [bytes([i]) * 32 for i in range(40)]
    assert await tier.get_many(keys) == {}  # connected
    redis_server.pause()
    try:
        for _ in range(2):
            assert await tier.get_many(keys) == {}  # timed out, running on
        started = time.perf_counter()
        assert await tier.get_many(keys) == {}
        assert time.perf_counter() - started < 0.01 and tier.asked == 3  # not sent
        with structlog.testing.capture_logs() as logged:
            for n in range(4):
                tier.put_many({bytes([n, i]) * 16: 0.5 for i in range(40)})
        assert tier.left_out == 80  # two batches queued (80 of 100), two left out
        assert [(e["event"], e["left_out"]) for e in logged] == [("score_cache_shared_error", 40)]
    finally:
        redis_server.resume()
        await tier.aclose()


# --- the breaker, by itself


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_breaker_opens_after_failures_in_a_row_and_probes_after_a_growing_wait() -> None:
    clock = Clock()
    breaker = Breaker("shared", clock)
    error = ConnectionError("reset")
    with structlog.testing.capture_logs() as logged:
        for _ in range(2):
            breaker.failed("connection", error)
        breaker.succeeded()  # a success in between: counted from zero again
        for _ in range(2):
            breaker.failed("connection", error)
        assert breaker.up
        breaker.failed("connection", error)
        assert not breaker.up
        breaker.failed("connection", error)  # calls ending after it opened: no change

        waits = []
        for _ in range(7):
            start = clock.now
            while not breaker.probe_due():
                clock.now += 0.25
            assert not breaker.probe_due()  # one probe at a time
            waits.append(clock.now - start)
            breaker.probed(ok=False)
        assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
        clock.now += 30
        assert breaker.probe_due()
        breaker.probed(ok=True)
        assert breaker.up
    assert [e["event"] for e in logged] == ["shared_down", "shared_up"]
    assert logged[0]["error"] == "connection" and logged[0]["failures"] == 3


def test_a_breaker_that_flaps_waits_longer_each_time_until_a_call_succeeds() -> None:
    clock = Clock()
    breaker = Breaker("shared", clock)

    def open_and_probe() -> float:
        for _ in range(3):
            breaker.failed("timeout", TimeoutError())
        start = clock.now
        while not breaker.probe_due():
            clock.now += 0.5
        breaker.probed(ok=True)
        return clock.now - start

    assert [open_and_probe() for _ in range(3)] == [1.0, 2.0, 4.0]
    breaker.succeeded()
    assert open_and_probe() == 1.0


# --- the tiers, in order


@dataclasses.dataclass
class DictTier:
    """A SharedTier in a dict: what it was asked and given."""

    held: dict[bytes, float] = dataclasses.field(default_factory=dict)
    asked: list[list[bytes]] = dataclasses.field(default_factory=list)
    closed: bool = False

    async def get_many(self, keys: list[bytes]) -> dict[bytes, float]:
        self.asked.append(keys)
        return {k: self.held[k] for k in keys if k in self.held}

    def put_many(self, scores: Mapping[bytes, float]) -> None:
        self.held.update(scores)

    async def aclose(self) -> None:
        self.closed = True


async def test_lookups_go_memory_then_shared_then_disk_and_lower_hits_are_remembered(
    tmp_path: Path,
) -> None:
    shared = DictTier()
    cache = ScoreCache(100, 60, tmp_path / "scores.sqlite", shared=shared)
    try:
        a, b, c, d = (bytes([i]) * 32 for i in range(4))
        cache.put_many({a: 0.1})  # all tiers
        await cache.flush()
        assert shared.held == {a: 0.1}
        shared.held[b] = 0.2  # another replica's
        disk_only = ScoreCache(0, 60, tmp_path / "scores.sqlite")
        disk_only.put_many({c: 0.3})
        await disk_only.aclose()

        found = await cache.get_many([a, b, c, d])
        assert found == {a: 0.1, b: 0.2, c: 0.3}
        assert shared.asked == [[b, c, d]]  # memory had a
        shared.held.clear()
        assert await cache.get_many([a, b, c]) == {a: 0.1, b: 0.2, c: 0.3}  # from memory
        assert shared.asked == [[b, c, d]]
    finally:
        await cache.aclose()
    assert shared.closed
