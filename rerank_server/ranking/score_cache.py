"""The score cache: reranker scores keyed by what determines them, in memory, in a tier
replicas share (Redis or Valkey, through `SharedTier`), and on disk.

What is keyed and kept: docs/api.md, "Score cache".
"""

from __future__ import annotations

import asyncio
import hashlib
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import structlog

from ..observability.metrics import CACHE_RESULT, CACHE_TIER, Metrics

log = structlog.get_logger(__name__)

PURGE_EVERY_S = 600.0
# Requests' writes waiting for the disk at most; past it a request's scores are not written
# to disk. One writer thread commits some hundreds a second, alone; workers sharing a file
# take turns at its lock, each write waiting up to BUSY_TIMEOUT_S: without a bound, a
# server busier than its disk queued writes (and their scores) without end, and flushed
# them all at shutdown.
MAX_PENDING_WRITES = 64
BEHIND_LOG_EVERY_S = 60.0

# A lookup's counts, their attributes made once: this runs for every request.
_MEMORY_HITS = {CACHE_RESULT: "hit", CACHE_TIER: "memory"}
_SHARED_HITS = {CACHE_RESULT: "hit", CACHE_TIER: "shared"}
_DISK_HITS = {CACHE_RESULT: "hit", CACHE_TIER: "disk"}
_MISSES = {CACHE_RESULT: "miss"}
_BYPASSES = {CACHE_RESULT: "bypass"}


class SharedTier(Protocol):
    """Scores that several servers share, asked after memory and before the disk
    (`fleet.shared_cache`: Redis or Valkey; the core sees only this protocol).

    An aid, never a cause of failure or delay: `get_many` returns within the tier's own
    bound, without what it could not read by then, and never raises for the tier's
    sake; `put_many` returns at once (the scores go out in the background, or not at
    all while the tier is down or behind).
    """

    async def get_many(self, keys: list[bytes]) -> dict[bytes, float]:
        """The scores held for `keys` (digests as `Scope.keys` makes them)."""
        ...

    def put_many(self, scores: Mapping[bytes, float]) -> None:
        """Offer `scores` to the other servers; returns at once."""
        ...

    async def aclose(self) -> None:
        """Send what is queued, within a bound, and close the connections."""
        ...


def _hashing(parts: Iterable[str], digest: hashlib._Hash | None = None) -> hashlib._Hash:
    """`digest` (a new SHA-256 by default) updated with `parts`, each length-prefixed so
    ("ab", "c") and ("a", "bc") differ."""
    digest = digest or hashlib.sha256()
    for part in parts:
        data = part.encode()
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest


def cache_key(
    backend: str,
    model: str,
    instruction: str,
    query: str,
    document: str,
    max_tokens: int | None = None,
    variant: str = "",
    identity: str = "",
) -> bytes:
    return _hashing(
        (
            backend,
            model,
            instruction,
            query,
            *_optional(max_tokens, variant, identity),
            document,
        )
    ).digest()


def _optional(max_tokens: int | None, variant: str, identity: str) -> tuple[str, ...]:
    """The token limit, the scorer's variant and the model file's identity as key parts,
    each only when set: a key without them is the one made without these parts."""
    parts = (
        f"max_tokens_per_doc={max_tokens}" if max_tokens else "",
        f"variant={variant}" if variant else "",
        f"identity={identity}" if identity else "",
    )
    return tuple(p for p in parts if p)


@dataclass(frozen=True, slots=True)
class Scope:
    """What a request's scores depend on besides the document."""

    backend: str
    model: str
    instruction: str
    query: str
    max_tokens: int | None = None  # the request's max_tokens_per_doc
    variant: str = ""  # the scorer's (`Scorer.variant`)
    identity: str = ""  # the model file's sha256, where the server knows it

    def key(self, document: str) -> bytes:
        return cache_key(
            self.backend,
            self.model,
            self.instruction,
            self.query,
            document,
            self.max_tokens,
            self.variant,
            self.identity,
        )

    def keys(self, documents: Iterable[str]) -> list[bytes]:
        """`key` of each document: the four shared parts are hashed once and the digest
        copied for each document (the same keys in half the time for 40 passages)."""
        shared = _hashing(
            (
                self.backend,
                self.model,
                self.instruction,
                self.query,
                *_optional(self.max_tokens, self.variant, self.identity),
            )
        )
        keys = []
        for document in documents:
            data = document.encode()
            digest = shared.copy()
            digest.update(len(data).to_bytes(8, "little"))
            digest.update(data)
            keys.append(digest.digest())
        return keys


@dataclass(frozen=True, slots=True)
class Lookup:
    """What `ScoreCache.lookup` found for a request's documents, and their keys (None
    when the cache is off), which `store` reuses."""

    scope: Scope
    documents: Sequence[str]
    keys: list[bytes] | None
    hits: dict[int, float]


class ScoreCache:
    """Memory LRU with expiry, optionally backed by a shared tier and a SQLite file.

    The pipeline calls `lookup` and `store`, which key a request's documents once and
    count hits (by tier), misses and bypasses; `get_many` and `put_many` take ready keys.
    A lookup asks memory, then the shared tier for what memory lacks, then the disk for
    the rest; what a lower tier had is remembered in memory. Only successful scores are
    stored, in every tier. The shared tier and the disk are aids, never a cause of
    failure: an error reading either is a miss, an error writing it a logged warning.

    A score read from the shared tier is kept in memory for `ttl_s` from then: the
    tier's own expiry (the same `ttl_s`, from when it was written) is not read back.
    """

    def __init__(
        self,
        max_entries: int,
        ttl_s: float,
        path: Path | None = None,
        clock: Callable[[], float] = time.time,
        metrics: Metrics | None = None,
        shared: SharedTier | None = None,
    ) -> None:
        self._lookups = (metrics or Metrics.noop()).cache_lookups
        self._shared = shared
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._clock = clock
        self._memory: OrderedDict[bytes, tuple[float, float]] = OrderedDict()  # score, stored
        self._disk = _open_disk(path, ttl_s, clock) if path is not None else None
        self._writer = (
            ThreadPoolExecutor(1, thread_name_prefix="score-cache-writer")
            if self._disk is not None
            else None
        )
        self._writes: set[asyncio.Future[None]] = set()
        self._left_out = 0  # writes not queued, the disk behind (MAX_PENDING_WRITES)
        self._behind_logged = -BEHIND_LOG_EVERY_S
        self._purged = -PURGE_EVERY_S  # expired rows go at start-up, then every so often
        self._purge(clock())

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0 or self._disk is not None or self._shared is not None

    @property
    def shared(self) -> SharedTier | None:
        return self._shared

    def __len__(self) -> int:
        return len(self._memory)

    async def lookup(
        self,
        scope: Scope,
        documents: Sequence[str],
        *,
        bypass: bool = False,
    ) -> Lookup:
        """Cached scores by position in `documents` (none when bypassed or disabled), and
        the documents' keys for `store`."""
        if not self.enabled or not documents:
            return Lookup(scope, documents, None, {})
        keys = scope.keys(documents)
        if bypass:
            self._lookups.add(len(documents), _BYPASSES)
            return Lookup(scope, documents, keys, {})
        found = await self.get_many(keys)
        self._lookups.add(len(keys) - len(found), _MISSES)
        return Lookup(
            scope, documents, keys, {i: found[key] for i, key in enumerate(keys) if key in found}
        )

    def store(self, looked_up: Lookup, scope: Scope, scores: Mapping[int, float]) -> None:
        """Remember `scores`, by position in the looked-up documents, under `scope`: with
        the lookup's keys when the scope is the same (keying is a SHA-256 of each text,
        as much CPU as the rest of a batched request's ranking), else keyed anew (the
        model may have become known from the answers since)."""
        if not self.enabled or not scores:
            return
        if looked_up.keys is not None and scope == looked_up.scope:
            keys = looked_up.keys
            self.put_many({keys[i]: score for i, score in scores.items()})
        else:
            documents = looked_up.documents
            self.put_many(
                dict(zip(scope.keys(documents[i] for i in scores), scores.values(), strict=True))
            )

    async def get_many(self, keys: Iterable[bytes]) -> dict[bytes, float]:
        """The cached scores among `keys` that have not expired, from any tier; the hits
        counted by the tier they came from (`lookup` counts the misses)."""
        now = self._clock()
        found: dict[bytes, float] = {}
        missing: list[bytes] = []
        for key in keys:
            entry = self._memory.get(key)
            if entry is not None and now - entry[1] < self.ttl_s:
                self._memory.move_to_end(key)
                found[key] = entry[0]
            else:
                if entry is not None:
                    del self._memory[key]
                missing.append(key)
        self._lookups.add(len(found), _MEMORY_HITS)
        if missing and self._shared is not None:
            from_shared = await self._shared.get_many(missing)
            self._lookups.add(len(from_shared), _SHARED_HITS)
            if from_shared:
                for key, score in from_shared.items():
                    found[key] = score
                    self._remember(key, score, now)
                missing = [key for key in missing if key not in from_shared]
        if missing and self._disk is not None:
            try:
                from_disk = await asyncio.to_thread(self._disk.get_many, missing)
            except sqlite3.Error as exc:  # locked past the timeout, corrupt, gone: a miss
                log.warning("score_cache_disk_error", op="read", error=type(exc).__name__)
                return found
            self._lookups.add(len(from_disk), _DISK_HITS)
            for key, (score, stored) in from_disk.items():
                found[key] = score
                self._remember(key, score, stored)
        return found

    def put_many(self, scores: Mapping[bytes, float]) -> None:
        """Store `scores`: in memory now, in the shared tier and on disk in the
        background (see `flush`)."""
        if not scores:
            return
        now = self._clock()
        if self.max_entries > 0:
            # `_remember` inline, the bound enforced once: this runs for every pair scored.
            memory, pop = self._memory, self._memory.pop
            for key, score in scores.items():
                pop(key, None)  # a key stored again moves to the most recent end
                memory[key] = (score, now)
            for _ in range(len(memory) - self.max_entries):
                memory.popitem(last=False)
        if self._shared is not None:
            self._shared.put_many(scores)
        if self._disk is not None:
            self._purge(now)
            if len(self._writes) >= MAX_PENDING_WRITES:
                self._behind(now)
                return
            write = asyncio.get_running_loop().run_in_executor(
                self._writer, self._disk.put_many, dict(scores), now
            )
            self._writes.add(write)
            write.add_done_callback(_written)
            write.add_done_callback(self._writes.discard)

    def _behind(self, now: float) -> None:
        """A write left out: counted, and logged at most every BEHIND_LOG_EVERY_S."""
        self._left_out += 1
        if now - self._behind_logged >= BEHIND_LOG_EVERY_S:
            self._behind_logged = now
            log.warning(
                "score_cache_disk_error",
                op="write",
                error="WritesBehind",
                pending=len(self._writes),
                left_out=self._left_out,
            )

    async def flush(self) -> None:
        """Wait until every score stored so far is on disk (or failed to get there)."""
        if self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)

    def _purge(self, now: float) -> None:
        """Delete the expired rows on the writer thread, at most every `PURGE_EVERY_S`:
        the file would otherwise only grow between restarts, and the start-up scan that
        grows with it would hold up the event loop (docs/decisions.md, "Figures behind
        the code's bounds")."""
        if self._disk is None or self._writer is None or now - self._purged < PURGE_EVERY_S:
            return
        self._purged = now
        self._writer.submit(self._disk.purge, now - self.ttl_s).add_done_callback(_written)

    def _remember(self, key: bytes, score: float, stored: float) -> None:
        if self.max_entries <= 0:
            return
        self._memory[key] = (score, stored)
        self._memory.move_to_end(key)
        while len(self._memory) > self.max_entries:
            self._memory.popitem(last=False)

    async def aclose(self) -> None:
        try:
            if self._shared is not None:
                await self._shared.aclose()
        finally:
            await self.flush()
            if self._disk is not None:
                await asyncio.to_thread(self._disk.close)
            if self._writer is not None:
                await asyncio.to_thread(self._writer.shutdown)  # after a purge under way


def _open_disk(path: Path, ttl_s: float, clock: Callable[[], float]) -> _Disk | None:
    """The disk side, or None (memory only) when the file is not a database SQLite can
    use, or its directory cannot be made: a cache must not keep the server from
    starting. A file is left in place for the operator (workers sharing it would race
    to replace it)."""
    try:
        return _Disk(path, ttl_s, clock)
    except sqlite3.DatabaseError as exc:
        # Also a directory this user cannot write (SQLite cannot open the file there).
        log.error(
            "score_cache_file_unusable",
            path=str(path),
            error=type(exc).__name__,
            detail=str(exc),
            action="memory only; to cache on disk again, delete or "
            "move a file that is not a SQLite database, or give --cache-path a "
            "directory this user can write",
        )
    except OSError as exc:  # no permission for the directory, a read-only file system
        log.error(
            "score_cache_file_unusable",
            path=str(path),
            error=type(exc).__name__,
            detail=exc.strerror or str(exc),
            action="memory only; give --cache-path a directory this user can write",
        )
    return None


def _written(write: asyncio.Future[None] | Future[None]) -> None:
    """A background write's end: a failure is logged (and so retrieved), not raised."""
    if not write.cancelled() and (exc := write.exception()) is not None:
        log.warning("score_cache_disk_error", op="write", error=type(exc).__name__)


class _Disk:
    """The SQLite side; every method runs in a worker thread (writes on the writer
    thread, one at a time; lookups on their own connection)."""

    BUSY_TIMEOUT_S = 5.0  # how long a write waits for another process's write lock

    def __init__(self, path: Path, ttl_s: float, clock: Callable[[], float]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._db = sqlite3.connect(
            path, check_same_thread=False, isolation_level=None, timeout=self.BUSY_TIMEOUT_S
        )
        try:
            self._set_up()
            self._reader = sqlite3.connect(
                path, check_same_thread=False, isolation_level=None, timeout=self.BUSY_TIMEOUT_S
            )
        except BaseException:
            self._db.close()
            raise
        self._read_lock = threading.Lock()  # lookups may come from several threads

    def _set_up(self) -> None:
        """WAL and the table. Workers opening a new file together contend for it, and
        SQLite's busy timeout does not wait out the switch to WAL: a busy or locked
        database is tried again for up to BUSY_TIMEOUT_S (failing at once would leave
        the worker without the disk cache for the rest of its life)."""
        deadline = time.monotonic() + self.BUSY_TIMEOUT_S
        while True:
            try:
                self._db.execute("PRAGMA journal_mode=WAL")
                # A cache: a power cut may lose the last few writes (WAL keeps the file
                # whole), and a commit need not wait for the disk.
                self._db.execute("PRAGMA synchronous=NORMAL")
                self._db.execute(
                    "CREATE TABLE IF NOT EXISTS scores (key BLOB PRIMARY KEY, "
                    "score REAL NOT NULL, stored REAL NOT NULL) WITHOUT ROWID"
                )
                return
            except sqlite3.OperationalError as exc:
                code = getattr(exc, "sqlite_errorcode", 0) & 0xFF  # the primary code
                if (
                    code not in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
                    or time.monotonic() >= deadline
                ):
                    raise
                time.sleep(0.01)

    def get_many(self, keys: list[bytes]) -> dict[bytes, tuple[float, float]]:
        oldest = self._clock() - self._ttl_s
        found: dict[bytes, tuple[float, float]] = {}
        with self._read_lock:
            for start in range(0, len(keys), 500):  # SQLite caps bound parameters
                chunk = keys[start : start + 500]
                marks = ",".join("?" * len(chunk))
                rows = self._reader.execute(
                    f"SELECT key, score, stored FROM scores WHERE key IN ({marks}) AND stored >= ?",
                    (*chunk, oldest),
                )
                found.update((key, (score, stored)) for key, score, stored in rows)
        return found

    def put_many(self, scores: Mapping[bytes, float], stored: float) -> None:
        with self._lock:
            try:
                # IMMEDIATE: wait (the busy timeout) for the write lock up front, rather
                # than fail on upgrading a read to a write half-way.
                self._db.execute("BEGIN IMMEDIATE")
                self._db.executemany(
                    "INSERT OR REPLACE INTO scores VALUES (?, ?, ?)",
                    [(key, score, stored) for key, score in scores.items()],
                )
                self._db.execute("COMMIT")
            except BaseException:
                # Left open, the transaction would fail every later BEGIN, pin this
                # connection's snapshot (no other worker's scores seen) and stop the WAL
                # from being checkpointed.
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise

    def purge(self, oldest: float) -> None:
        with self._lock:
            self._db.execute("DELETE FROM scores WHERE stored < ?", (oldest,))

    def close(self) -> None:
        with self._read_lock:
            self._reader.close()
        with self._lock:
            self._db.close()
