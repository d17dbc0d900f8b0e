"""The score cache's shared tier over Redis or Valkey: what one replica scored, the
others answer from (docs/api.md, "Score cache").

A key is `--cache-key-prefix` and the cache's own 32-byte digest (`Scope.keys`: backend
kind, model, variant, instruction, query, text, hashed; never the text itself); its
value the score as a decimal (`repr` of the float, read back exactly), written with an
expiry of `--cache-ttl-s`. A lookup is one MGET of the keys memory did not hold,
waited for at most `--cache-timeout-ms`: what is not back by then is a miss. Stores
never wait: they join a queue that one writer task sends a batch at a time; a queue
already holding `MAX_QUEUED_SCORES` takes no more (counted, logged once a minute).

A batch is one EVALSHA of `WRITE_SCRIPT` (a `SET ... PX` per key, run in Redis), not
a pipeline of SETs: redis-py's cost is per command, paid on the servers whose CPU is the
fleet's to spend (docs/benchmarks.md, "A shared score cache").
Where scripts are refused (an ACL without @scripting, EVALSHA renamed away) the writes
fall back to the pipeline.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from functools import partial
from itertools import islice
from typing import Any

import structlog
from opentelemetry import trace
from redis.asyncio import Redis
from redis.exceptions import NoPermissionError, ResponseError

from ..observability.metrics import ERROR_TYPE, Metrics
from ..settings import Settings
from .redis_client import (
    DOWN,
    OTHER,
    Breaker,
    RedisLink,
    Unavailable,
    client_from_url,
    error_detail,
)
from .writes import BackgroundWriter, WritingClient

log = structlog.get_logger(__name__)

# Scores waiting for the writer, at most: a Redis slower than the servers' scoring
# must not grow a queue without end, nor hold up shutdown with it.
MAX_QUEUED_SCORES = 20_000
# Scores per script call: Redis runs a script alone, and a short one keeps the other
# clients' calls waiting well under a millisecond.
WRITE_BATCH = 200
BEHIND_LOG_EVERY_S = 60.0
_PROBE_KEY = b"probe"  # never written: a probe reads it as a request would
# KEYS: the keys; ARGV: their scores, then the expiry in milliseconds.
WRITE_SCRIPT = """
local px = ARGV[#ARGV]
for i, key in ipairs(KEYS) do
  redis.call('SET', key, ARGV[i], 'PX', px)
end
return #KEYS
"""


class RedisScoreTier(WritingClient):
    """`score_cache.SharedTier` over a `RedisLink`. `asked` counts the MGETs sent and
    `left_out` the stores not sent (the queue full), for tests and logs."""

    def __init__(
        self,
        link: RedisLink,
        *,
        prefix: bytes,
        ttl_s: float,
        wait_s: float,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.link = link
        self._prefix = prefix
        self._ttl_ms = round(ttl_s * 1000)
        self._wait_s = wait_s
        self._durations = (metrics or Metrics.noop()).cache_shared_duration
        self._clock = clock
        self._queue: dict[bytes, float] = {}
        self._writes = BackgroundWriter(
            self._take, self._write, event="score_cache_shared_error", op="write", clock=clock
        )
        self._script = link.client.register_script(WRITE_SCRIPT)  # its digest; no call
        self._scripted = True
        self.left_out = 0
        self._behind_logged = -BEHIND_LOG_EVERY_S

    @classmethod
    def from_settings(cls, settings: Settings, metrics: Metrics | None = None) -> RedisScoreTier:
        """The tier `--cache-url` names (raises ConfigError for one that cannot work).
        Nothing is connected yet: the first lookup or store connects."""
        prefix = settings.cache_key_prefix.encode()
        probe_key = prefix + _PROBE_KEY

        async def probe(redis: Redis) -> object:
            return await redis.mget([probe_key])

        link = RedisLink(
            client_from_url(settings.cache_url, settings.cache_tls_ca),
            Breaker("score_cache_shared"),
            probe,
        )
        return cls(
            link,
            prefix=prefix,
            ttl_s=settings.cache_ttl_s,
            wait_s=settings.cache_timeout_ms / 1000,
            metrics=metrics,
        )

    @property
    def asked(self) -> int:
        return self.link.reads

    async def get_many(self, keys: list[bytes]) -> dict[bytes, float]:
        """The scores Redis holds for `keys`, as far as they came back within the
        bound; a value that is not a score on 0..1 (not ours) is a miss."""
        if not keys or not self.link.usable():
            return {}
        prefix = self._prefix
        names = [prefix + key for key in keys]

        async def mget(redis: Redis) -> list[bytes | str | None]:
            values: list[bytes | str | None] = await redis.mget(names)
            return values

        started = time.perf_counter()
        try:
            values = await self.link.read(mget, self._wait_s)
        except Unavailable as exc:
            if exc.kind != DOWN:  # while down, nothing is asked, nothing is counted
                self._read(time.perf_counter() - started, exc.kind, 0)
            return {}
        found: dict[bytes, float] = {}
        if len(values) != len(keys):  # not Redis's answer to this MGET: all misses
            self._read(time.perf_counter() - started, OTHER, 0)
            return {}
        for key, value in zip(keys, values, strict=True):
            if value is not None:
                try:
                    score = float(value)
                except ValueError:
                    continue
                if 0.0 <= score <= 1.0:  # and not NaN
                    found[key] = score
        self._read(time.perf_counter() - started, None, len(found))
        return found

    def _read(self, seconds: float, error: str | None, hits: int) -> None:
        """One read's duration, and on the request's span when traced."""
        self._durations.record(seconds, {ERROR_TYPE: error} if error else None)
        span = trace.get_current_span()
        if span.is_recording():
            attributes: dict[str, Any] = {
                "rerank.cache.shared.ms": round(seconds * 1000, 3),
                "rerank.cache.shared.hits": hits,
            }
            if error:
                attributes["rerank.cache.shared.error"] = error
            span.set_attributes(attributes)

    def put_many(self, scores: Mapping[bytes, float]) -> None:
        """Queue `scores` for the writer; dropped while Redis is down, and counted in
        `left_out` when the queue is full."""
        if not scores or self._ttl_ms <= 0 or not self.link.usable():
            return
        if len(self._queue) + len(scores) > MAX_QUEUED_SCORES:
            self._behind(len(scores))
            return
        self._queue.update(scores)
        self._writes.wake()

    def _take(self) -> dict[bytes, float]:
        """The writer's next batch: the first WRITE_BATCH scores queued (empty: none)."""
        if len(self._queue) <= WRITE_BATCH:
            batch, self._queue = self._queue, {}
            return batch
        keys = list(islice(self._queue, WRITE_BATCH))
        return {key: self._queue.pop(key) for key in keys}

    async def _write(self, batch: dict[bytes, float]) -> None:
        await self.link.write(partial(self._send, batch=batch))

    async def _send(self, redis: Redis, *, batch: dict[bytes, float]) -> None:
        prefix = self._prefix
        keys = [prefix + key for key in batch]
        # float(): a numpy float's repr is not a number's text.
        scores = [repr(float(score)) for score in batch.values()]
        if self._scripted:
            try:
                await self._script(keys=keys, args=[*scores, self._ttl_ms], client=redis)
                return
            except ResponseError as exc:
                if not _scripts_refused(exc):
                    raise
                self._scripted = False
                log.info(
                    "score_cache_shared_no_scripts",
                    error_type=type(exc).__name__,
                    detail=error_detail(exc),
                    action="scores written as pipelines of SET instead",
                )
        async with redis.pipeline(transaction=False) as pipe:
            for key, score in zip(keys, scores, strict=True):
                pipe.set(key, score, px=self._ttl_ms)
            # Raised here, not by execute(): that one writes the failed command, key
            # and score, into the error's text, which the refused writes' log shows.
            for result in await pipe.execute(raise_on_error=False):
                if isinstance(result, Exception):
                    raise result

    def _behind(self, scores: int) -> None:
        """Scores left out, the queue full: counted, logged at most once a minute."""
        self.left_out += scores
        now = self._clock()
        if now - self._behind_logged >= BEHIND_LOG_EVERY_S:
            self._behind_logged = now
            log.warning(
                "score_cache_shared_error",
                op="write",
                error="WritesBehind",
                queued=len(self._queue),
                left_out=self.left_out,
            )


def _scripts_refused(error: ResponseError) -> bool:
    """Whether Redis refuses scripts themselves (not what a script did)."""
    text = str(error).lower()
    return isinstance(error, NoPermissionError) or "unknown command" in text or "noperm" in text
