"""The score cache end to end: the fake backend receives exactly the pairs not cached."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import sqlite3
import threading
import time
from pathlib import Path

import pytest
import structlog.testing
from rerank_client import AsyncRerankClient

from rerank_server.domain import Candidate, RerankQuery
from rerank_server.ranking.pipeline import Reranker
from rerank_server.ranking.score_cache import (
    MAX_PENDING_WRITES,
    PURGE_EVERY_S,
    Scope,
    ScoreCache,
    _Disk,
    cache_key,
)
from rerank_server.scoring.backends import prompt
from rerank_server.scoring.backends.chat import ChatScorer
from rerank_server.scoring.backends.completion import CompletionScorer
from rerank_server.scoring.base import Emit, ScoreRequest
from rerank_server.scoring.transport.pool import BackendPool
from rerank_server.server import request_rules
from rerank_server.settings import Settings
from tests.conftest import StartServer, client_of
from tests.fakes.llama import FakeLlamaServer
from tests.fakes.scorer import FunctionScorer

DOCS = ["apples are red", "bananas are yellow", "cherries are dark"]


async def test_identical_request_scores_nothing_and_answers_the_same(
    client: AsyncRerankClient, fake_llama: FakeLlamaServer
) -> None:
    fake_llama.scores = {"bananas": 0.9, "cherries": 0.6}
    first = await client.rerank("fruit", DOCS)
    second = await client.rerank("fruit", DOCS)
    assert len(fake_llama.requests) == 3
    assert second.summary.cached == 3 and second.summary.scored == 3
    assert all(r.cached for r in second.results) and not any(r.cached for r in first.results)
    assert [(r.id, r.score) for r in second.results] == [(r.id, r.score) for r in first.results]


async def test_overlapping_request_scores_only_new_pairs(
    client: AsyncRerankClient, fake_llama: FakeLlamaServer
) -> None:
    await client.rerank("fruit", DOCS)
    answer = await client.rerank("fruit", [*DOCS[1:], "dates are sweet", "figs are soft"])
    assert sorted(fake_llama.documents()[3:]) == ["dates are sweet", "figs are soft"]
    assert len(fake_llama.requests) == 5
    assert answer.summary.cached == 2 and answer.summary.scored == 4


async def test_key_covers_query_instruction_and_text(
    client: AsyncRerankClient, fake_llama: FakeLlamaServer
) -> None:
    await client.rerank("fruit", DOCS)
    await client.rerank("other query", DOCS)
    await client.rerank("fruit", DOCS, instruction="Find recipes")
    assert len(fake_llama.requests) == 9


async def test_bypass_reads_nothing_but_refreshes(
    client: AsyncRerankClient, fake_llama: FakeLlamaServer
) -> None:
    await client.rerank("fruit", DOCS)
    bypassed = await client.rerank("fruit", DOCS, bypass_cache=True)
    assert len(fake_llama.requests) == 6 and bypassed.summary.cached == 0
    assert (await client.rerank("fruit", DOCS)).summary.cached == 3


async def test_entries_expire(start_server: StartServer, fake_llama: FakeLlamaServer) -> None:
    server = await start_server(cache_ttl_s=0.3)
    async with client_of(server) as client:
        await client.rerank("fruit", DOCS)
        assert (await client.rerank("fruit", DOCS)).summary.cached == 3
        await asyncio.sleep(0.4)
        assert (await client.rerank("fruit", DOCS)).summary.cached == 0
    assert len(fake_llama.requests) == 6


async def test_cache_off_scores_every_time(
    start_server: StartServer, fake_llama: FakeLlamaServer
) -> None:
    server = await start_server(cache_entries=0)
    async with client_of(server) as client:
        await client.rerank("fruit", DOCS)
        await client.rerank("fruit", DOCS)
    assert len(fake_llama.requests) == 6


async def test_failed_pairs_are_not_cached(
    client: AsyncRerankClient, fake_llama: FakeLlamaServer
) -> None:
    fake_llama.failing_markers = ("bananas",)
    await client.rerank("fruit", DOCS)
    fake_llama.failing_markers = ()
    answer = await client.rerank("fruit", DOCS)
    assert answer.summary.cached == 2 and answer.summary.failed == 0
    assert fake_llama.documents()[-1] == "bananas are yellow"


async def test_sqlite_cache_survives_a_restart(
    start_server: StartServer, fake_llama: FakeLlamaServer, tmp_path: Path
) -> None:
    path = tmp_path / "scores.sqlite"
    first = await start_server(cache_path=str(path))
    async with client_of(first) as client:
        await client.rerank("fruit", DOCS)
    await first.stop(grace=0)
    second = await start_server(cache_path=str(path))
    await asyncio.wait_for(second.monitor.ready.wait(), 5)  # model name known: keys match
    async with client_of(second) as client:
        answer = await client.rerank("fruit", DOCS)
    assert answer.summary.cached == 3
    assert len(fake_llama.requests) == 3
    assert b"apples" not in path.read_bytes()  # keys are digests; no text on disk


async def test_memory_is_bounded_least_recently_used_first() -> None:
    cache = ScoreCache(max_entries=2, ttl_s=60)
    a, b, c = (cache_key("chat", "m", "i", "q", d) for d in "abc")
    cache.put_many({a: 0.1, b: 0.2})
    assert await cache.get_many([a]) == {a: 0.1}  # a is now the most recent
    cache.put_many({c: 0.3})
    assert await cache.get_many([a, b, c]) == {a: 0.1, c: 0.3}
    assert len(cache) == 2


def test_keys_do_not_collide_across_field_boundaries() -> None:
    assert cache_key("chat", "m", "i", "ab", "c") != cache_key("chat", "m", "i", "a", "bc")


def test_a_requests_keys_are_each_documents_own_key() -> None:
    """`Scope.keys` hashes the shared parts once: the keys must be `cache_key`'s, so a
    cache on disk written before keeps its hits."""
    scope = Scope("chat", "model", "instruction", "query")
    documents = ["", "a", "ab", "naïve café ☕", "x" * 5000]
    assert scope.keys(documents) == [
        cache_key("chat", "model", "instruction", "query", d) for d in documents
    ]
    assert scope.keys(["ab"]) != Scope("chat", "model", "instruction", "querya").keys(["b"])


async def test_scores_are_stored_under_the_scope_known_when_they_arrive() -> None:
    """The model can become known from the answers (llama-server without --model): the
    pairs looked up under no model are stored under the one named since, keyed anew, not
    under the lookup's keys."""
    cache = ScoreCache(max_entries=100, ttl_s=60)
    before, after = Scope("chat", "", "i", "q"), Scope("chat", "m", "i", "q")
    looked_up = await cache.lookup(before, DOCS)
    assert looked_up.hits == {}
    cache.store(looked_up, after, {0: 0.25, 2: 0.75})
    assert (await cache.lookup(after, DOCS)).hits == {0: 0.25, 2: 0.75}
    assert (await cache.lookup(before, DOCS)).hits == {}
    # Unchanged scope: the lookup's own keys.
    again = await cache.lookup(after, DOCS)
    cache.store(again, after, {1: 0.5})
    assert (await cache.lookup(after, DOCS)).hits == {0: 0.25, 1: 0.5, 2: 0.75}


async def test_one_store_larger_than_the_bound_keeps_its_newest() -> None:
    """`put_many` enforces the bound once per call: a batch over it keeps its last
    entries, and a key stored again moves to the most recent end."""
    cache = ScoreCache(max_entries=3, ttl_s=60)
    keys = [cache_key("chat", "m", "i", "q", str(n)) for n in range(10)]
    cache.put_many({key: n / 10 for n, key in enumerate(keys)})
    assert len(cache) == 3
    assert await cache.get_many(keys) == {keys[7]: 0.7, keys[8]: 0.8, keys[9]: 0.9}
    cache.put_many({keys[7]: 0.75, keys[0]: 0.0})  # 7 again: newest with 0; 8 goes
    assert await cache.get_many(keys) == {keys[9]: 0.9, keys[7]: 0.75, keys[0]: 0.0}


async def test_a_disk_only_cache_stores_and_finds(tmp_path: Path) -> None:
    """No memory entries (`--cache-entries 0`) with `--cache-path`: scores go to the disk
    and come back from it."""
    cache = ScoreCache(max_entries=0, ttl_s=60, path=tmp_path / "scores.sqlite")
    scope = Scope("chat", "m", "i", "q")
    cache.store(await cache.lookup(scope, DOCS), scope, {1: 0.5})
    await cache.flush()
    assert len(cache) == 0
    assert (await cache.lookup(scope, DOCS)).hits == {1: 0.5}
    await cache.aclose()


async def test_key_covers_the_token_limit(
    client: AsyncRerankClient, fake_llama: FakeLlamaServer
) -> None:
    """A request that lets the model read only 16 tokens of each document gets scores of
    16-token stubs: they must not answer a request without the limit."""
    await client.rerank("fruit", DOCS, max_tokens_per_doc=16)
    assert (await client.rerank("fruit", DOCS)).summary.cached == 0
    assert (await client.rerank("fruit", DOCS, max_tokens_per_doc=16)).summary.cached == 3
    assert (await client.rerank("fruit", DOCS)).summary.cached == 3


async def test_a_scorer_with_another_prompt_does_not_answer_from_the_cache(
    start_server: StartServer, fake_llama: FakeLlamaServer, tmp_path: Path
) -> None:
    """Scores earned with the think-block prefill are not the scores without it: a server
    restarted with `--no-assistant-prefill` on the same `--cache-path` scores afresh."""
    path = tmp_path / "scores.sqlite"
    for prefill, cached in ((True, 0), (False, 0), (True, 3), (False, 3)):
        server = await start_server(cache_path=str(path), assistant_prefill=prefill)
        await asyncio.wait_for(server.monitor.ready.wait(), 5)
        async with client_of(server) as client:
            assert (await client.rerank("fruit", DOCS)).summary.cached == cached
        await server.stop(grace=0)
    assert len(fake_llama.requests) == 6


def test_the_prompts_text_and_its_settings_are_in_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """A release that rewords a prompt keys its scores apart from the old wording's."""
    pool = BackendPool(["http://127.0.0.1:1"], concurrency=1, timeout_s=1, kind="chat")
    variants = {
        ChatScorer(pool).variant,
        ChatScorer(pool, assistant_prefill=False).variant,
        CompletionScorer(pool).variant,
    }
    assert len(variants) == 2 and "" not in variants  # completion speaks chat's prompt
    monkeypatch.setattr(prompt, "SYSTEM_PROMPT", prompt.SYSTEM_PROMPT + " Be brief.")
    assert ChatScorer(pool).variant not in variants
    scope = Scope("chat", "m", "i", "q")
    assert scope.keys(DOCS) == [cache_key("chat", "m", "i", "q", d) for d in DOCS]
    varied = dataclasses.replace(scope, variant=ChatScorer(pool).variant)
    assert set(varied.keys(DOCS)).isdisjoint(scope.keys(DOCS))
    assert varied.keys(DOCS) == [varied.key(d) for d in DOCS]


async def test_a_write_that_finds_the_disk_locked_does_not_stop_later_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process holding the write lock past the busy timeout fails one write; the
    transaction it left open would fail every later one (and pin this connection to an
    old snapshot) unless it is rolled back."""
    monkeypatch.setattr(_Disk, "BUSY_TIMEOUT_S", 0.1)
    path = tmp_path / "scores.db"
    cache = ScoreCache(0, 3600, path=path)  # disk only: what is found was read from it
    first, second = (cache_key("chat", "m", "i", "q", d) for d in "ab")
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # say, another worker's long clean-up
    cache.put_many({first: 0.25})
    await cache.flush()  # failed: logged, not raised
    other.execute("ROLLBACK")
    other.close()
    cache.put_many({second: 0.75})
    await cache.flush()
    assert await cache.get_many([first, second]) == {second: 0.75}
    await cache.aclose()


async def test_an_unreadable_disk_is_a_miss(tmp_path: Path) -> None:
    """A cache file that cannot be read (here: overwritten under the open cache) makes
    misses, not failed requests."""
    path = tmp_path / "scores.db"
    cache = ScoreCache(0, 3600, path=path)
    key = cache_key("chat", "m", "i", "q", "a")
    cache.put_many({key: 0.5})
    await cache.flush()
    assert await cache.get_many([key]) == {key: 0.5}

    def overwrite() -> None:
        for file in tmp_path.iterdir():
            file.write_bytes(b"\xff" * file.stat().st_size)

    await asyncio.to_thread(overwrite)
    assert await cache.get_many([key]) == {}
    cache.put_many({key: 0.5})  # fails in the background: logged
    await cache.flush()
    await asyncio.to_thread(cache._disk.close)  # type: ignore[union-attr]


async def test_a_lookup_does_not_wait_behind_a_blocked_write(tmp_path: Path) -> None:
    """Lookups read on a connection of their own: a write waiting for another process's
    lock (up to the busy timeout) does not hold up the request looking scores up."""
    path = tmp_path / "scores.db"
    cache = ScoreCache(0, 3600, path=path)  # disk only
    stored, blocked = (cache_key("chat", "m", "i", "q", d) for d in "ab")
    cache.put_many({stored: 0.5})
    await cache.flush()
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another worker writing
    cache.put_many({blocked: 0.75})  # waits for the lock in the background
    await asyncio.sleep(0.1)
    try:
        # Well inside the 5 s the write may wait: before, the lookup waited with it.
        assert await asyncio.wait_for(cache.get_many([stored]), 2.5) == {stored: 0.5}
    finally:
        other.execute("ROLLBACK")
        other.close()
    await cache.flush()
    assert await cache.get_many([blocked]) == {blocked: 0.75}
    await cache.aclose()


async def test_expired_rows_leave_the_disk_while_the_server_runs(tmp_path: Path) -> None:
    """Not only when the cache opens: the file would grow for as long as a server runs."""
    path = tmp_path / "scores.db"
    now = [0.0]
    cache = ScoreCache(0, 60, path=path, clock=lambda: now[0])
    old, new = (cache_key("chat", "m", "i", "q", d) for d in "ab")
    cache.put_many({old: 0.5})
    await cache.flush()
    now[0] = PURGE_EVERY_S + 1  # `old` expired long ago, and a purge is due
    cache.put_many({new: 0.75})
    await cache.aclose()  # waits for the purge on the writer thread too

    def rows() -> list[bytes]:
        with contextlib.closing(sqlite3.connect(path)) as db:
            return [key for (key,) in db.execute("SELECT key FROM scores")]

    assert await asyncio.to_thread(rows) == [new]


async def test_a_cache_file_that_is_not_a_database_leaves_the_cache_in_memory(
    tmp_path: Path,
) -> None:
    """A corrupt --cache-path file does not keep the server from starting (every worker
    exited 1): the cache runs in memory and says so."""
    path = tmp_path / "scores.db"
    await asyncio.to_thread(path.write_bytes, b"\xff" * 8192)
    cache = ScoreCache(10, 3600, path=path)
    key = cache_key("chat", "m", "i", "q", "a")
    cache.put_many({key: 0.5})
    assert await cache.get_many([key]) == {key: 0.5}
    await cache.aclose()
    assert await asyncio.to_thread(path.read_bytes) == b"\xff" * 8192  # left for the operator


async def test_a_cache_directory_that_cannot_be_made_leaves_the_cache_in_memory(
    start_server: StartServer, tmp_path: Path
) -> None:
    """A --cache-path whose directory cannot be made (here a file is in its way; as
    often: no permission, a read-only file system) does not keep the server from
    starting with a traceback: it serves, and caches in memory."""
    blocker = tmp_path / "not-a-directory"
    await asyncio.to_thread(blocker.write_bytes, b"")
    server = await start_server(cache_path=str(blocker / "scores.sqlite"))
    async with client_of(server) as client:
        await client.rerank("fruit", DOCS)
        assert (await client.rerank("fruit", DOCS)).summary.cached == 3


def test_processes_opening_a_new_cache_file_together_all_keep_it(tmp_path: Path) -> None:
    """Workers starting together on a new --cache-path contend for the switch to WAL,
    which SQLite's busy timeout does not wait out: about one opening in a hundred failed
    at once, leaving that worker without the disk cache until it was restarted. (Threads
    stand in for the processes: each opening is a connection of its own.)"""
    failed: list[BaseException] = []

    def open_disk(path: Path, start: threading.Barrier) -> None:
        start.wait()
        try:
            _Disk(path, 60, time.time).close()
        except sqlite3.DatabaseError as exc:
            failed.append(exc)

    for trial in range(100):
        start = threading.Barrier(6)
        path = tmp_path / f"scores-{trial}.sqlite"
        openers = [threading.Thread(target=open_disk, args=(path, start)) for _ in range(6)]
        for opener in openers:
            opener.start()
        for opener in openers:
            opener.join()
    assert failed == []


async def test_writes_a_busy_disk_cannot_take_are_left_out_not_queued(tmp_path: Path) -> None:
    """Another process holding the file's lock: requests' writes wait for the disk at
    most MAX_PENDING_WRITES deep; the scores after that stay in memory only (they were
    queued without end, as was the memory holding them)."""
    path = tmp_path / "scores.db"
    cache = ScoreCache(1000, 3600, path=path)
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another worker writing, for the busy timeout
    keys = [cache_key("chat", "m", "i", "q", str(n)) for n in range(MAX_PENDING_WRITES + 20)]
    try:
        with structlog.testing.capture_logs() as logged:
            for key in keys:
                cache.put_many({key: 0.5})
        assert len(cache._writes) == MAX_PENDING_WRITES
        assert await cache.get_many(keys) == {key: 0.5 for key in keys}  # memory has all
    finally:
        other.execute("ROLLBACK")
        other.close()
    await cache.flush()
    behind = [e for e in logged if e.get("error") == "WritesBehind"]
    assert len(behind) == 1 and behind[0]["left_out"] == 1  # logged once, at the first
    disk = ScoreCache(0, 3600, path=path)
    assert len(await disk.get_many(keys)) == MAX_PENDING_WRITES
    await disk.aclose()
    await cache.aclose()


async def test_scores_of_a_request_that_spanned_a_change_of_variant_are_not_stored() -> None:
    """A `rerank` backend's switch to logits in the middle of a request: the answers it
    read before the switch are on the probability scale, and stored under the new
    variant's keys they would meet logits in later rankings."""

    class Switching(FunctionScorer):
        async def score(self, request: ScoreRequest, emit: Emit) -> None:
            await super().score(request, emit)
            self.variant = "logits"  # the third logit answer arrived meanwhile

    def query(n: int) -> RerankQuery:
        return RerankQuery(
            request_id=f"r{n}",
            query="q",
            timeout_s=10.0,
            candidates=tuple(
                Candidate(id=str(i), text=d, index=i, retrieval_rank=i + 1)
                for i, d in enumerate(DOCS)
            ),
        )

    for scorer, stored in ((FunctionScorer(), True), (Switching(), False)):
        reranker = Reranker(
            request_rules(Settings(min_candidates=2)), scorer, cache=ScoreCache(100, 3600)
        )
        await reranker.answer(query(1))
        _, summary = await reranker.answer(query(2))
        assert (summary.cached == len(DOCS)) is stored
