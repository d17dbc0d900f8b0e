"""Per-token limits counted by every replica together, in the Redis or Valkey of
`--cache-url` (docs/security.md, "Per-token limits"): `limits.LimitCounter` over a
`RedisLink`.

Rates (`take`) are fixed windows: one counter per key and window, the window's number
taken from Redis's `TIME` inside the script (replicas' clocks may differ), named
`{prefix}limit:{NAME}:{LIMIT}:{window}` and expiring just after its window. A request
is counted or refused in one script call, so replicas never both take the last unit;
a burst at a window's end and another at the next window's start may reach twice the
limit in one window's time. Calls in progress (`enter`) are a sorted set per key,
`{prefix}limit:{NAME}:concurrent`: one member per place, named by the replica and a
sequence number and scored by when its lease (`lease_s`) ends on Redis's clock. Places
whose lease ended are dropped before counting, so those of a replica that died without
giving them back are free again a lease later, however busy the token. `leave` never
waits: places to give back are queued for one writer task, as the score cache's stores
are.

Fail open: a call that does not answer within `--cache-timeout-ms`, fails, or is not
sent (the breaker open: `limit_counter_down` / `limit_counter_up`, one line each) lets
the request through as if under its limit, counted in `rerank.limit.counter_errors`.
A place entered that way is given back locally, not in Redis. The client is this
counter's own (not the score cache's): its own connections and breaker, so a flood of
cache reads never keeps a request from being counted, and each logs its own state.
Scripts are required (atomic read-and-count); a Redis that refuses them fails open.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable
from functools import partial

import structlog
from redis.asyncio import Redis

from ..observability.metrics import ERROR_TYPE, LIMIT, Metrics
from ..security.limits import CONCURRENT
from ..settings import Settings
from .redis_client import Breaker, RedisLink, Unavailable, client_from_url
from .writes import BackgroundWriter, WritingClient

log = structlog.get_logger(__name__)

# A window's counter lives this long past its window's end: never gone before the end.
WINDOW_MARGIN_MS = 1000
# The shortest lease of a place: longer than a request, and than most RerankBatch
# streams, which hold one place each for the whole stream.
MIN_LEASE_S = 60.0
# KEYS: the key without its window; ARGV: amount, limit, window ms, margin ms. Returns
# 0 when counted, else the milliseconds left in the window (nothing counted).
TAKE_SCRIPT = """
local amount, limit, window = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local now = redis.call('TIME')
local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local left = window - ms % window
local key = KEYS[1] .. ':' .. string.format('%d', math.floor(ms / window))
local counted = redis.call('INCRBY', key, amount)
if counted == amount then
  redis.call('PEXPIRE', key, left + tonumber(ARGV[4]))
elseif counted > limit then
  redis.call('DECRBY', key, amount)
  return left
end
return 0
"""
# KEYS: the key; ARGV: limit, lease ms, the place's member. Returns 1 when entered, else
# 0. The set lives as long as its newest lease.
ENTER_SCRIPT = """
local now = redis.call('TIME')
local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ms)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then
  return 0
end
redis.call('ZADD', KEYS[1], ms + tonumber(ARGV[2]), ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""
# KEYS: a key per place; ARGV: the places' members. A member already gone (its lease
# ended, a Redis restarted meanwhile) is nothing to give back.
LEAVE_SCRIPT = """
for i, key in ipairs(KEYS) do
  redis.call('ZREM', key, ARGV[i])
end
return #KEYS
"""
# A probe calls a script, as the counter does: a user allowed PING but not scripts
# stays down.
PROBE_SCRIPT = "return redis.call('EXISTS', KEYS[1])"


class RedisLimitCounter(WritingClient):
    """`limits.LimitCounter` over a `RedisLink`: keys are `prefix` + the limiter's key,
    each call waits at most `wait_s`, a place is leased for `lease_s`."""

    def __init__(
        self,
        link: RedisLink,
        *,
        prefix: str,
        wait_s: float,
        lease_s: float,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.link = link
        self._prefix = prefix
        self._wait_s = wait_s
        self._lease_ms = max(1, round(lease_s * 1000))
        self._errors = (metrics or Metrics.noop()).limit_counter_errors
        client = link.client
        self._take = client.register_script(TAKE_SCRIPT)  # digests; nothing is sent
        self._enter = client.register_script(ENTER_SCRIPT)
        self._leave = client.register_script(LEAVE_SCRIPT)
        # Places entered without Redis (failing open), by the limiter's key: their
        # `leave` is local.
        self._uncounted: dict[str, int] = {}
        self._held: dict[str, list[str]] = {}  # Redis key: this replica's members
        self._places = itertools.count()
        self._replica = uuid.uuid4().hex[:12]
        self._leaving: list[tuple[str, str]] = []  # (Redis key, member) to give back
        self._writes = BackgroundWriter(
            self._take_leaving,
            self._give_back,
            event="limit_counter_error",
            op="leave",
            clock=clock,
        )

    @classmethod
    def from_settings(cls, settings: Settings, metrics: Metrics | None = None) -> RedisLimitCounter:
        """The counter in `--cache-url`, under `--cache-key-prefix` + `limit:` (raises
        ConfigError for a URL that cannot work). Nothing is connected yet."""
        prefix = settings.cache_key_prefix + "limit:"
        client = client_from_url(settings.cache_url, settings.cache_tls_ca)
        probe_script = client.register_script(PROBE_SCRIPT)
        probe_key = prefix + "probe"  # never written

        async def probe(redis: Redis) -> object:
            return await probe_script(keys=[probe_key], client=redis)

        return cls(
            RedisLink(client, Breaker("limit_counter"), probe),
            prefix=prefix,
            wait_s=settings.cache_timeout_ms / 1000,
            lease_s=max(MIN_LEASE_S, 2 * settings.timeout_ms / 1000),
            metrics=metrics,
        )

    async def take(self, key: str, amount: int, limit: int, window_s: float) -> float:
        """`LimitCounter.take` in the window Redis's clock is in; 0.0 (counted as if
        under the limit) when Redis does not answer in time."""
        name = self._prefix + key
        args = [amount, limit, max(1, round(window_s * 1000)), WINDOW_MARGIN_MS]

        async def call(redis: Redis) -> int:
            return int(await self._take(keys=[name], args=args, client=redis))

        try:
            left_ms = await self.link.read(call, self._wait_s)
        except Unavailable as exc:
            self._fell_back(key.rpartition(":")[2], exc.kind)
            return 0.0
        return left_ms / 1000

    async def enter(self, key: str, limit: int) -> bool:
        """`LimitCounter.enter` in Redis, renewing the key's lease; True (entered here
        only) when Redis does not answer in time. A place Redis gives after its caller
        stopped waiting (the bound passed, the call cancelled) is given back at once."""
        name = self._prefix + key
        member = f"{self._replica}:{next(self._places)}"
        args: list[str | int] = [limit, self._lease_ms, member]
        abandoned = False

        async def call(redis: Redis) -> bool:
            entered = bool(await self._enter(keys=[name], args=args, client=redis))
            if entered and abandoned:  # nobody holds this place
                await self._leave(keys=[name], args=[member], client=redis)
            return entered

        try:
            entered = await self.link.read(call, self._wait_s)
        except Unavailable as exc:
            abandoned = True
            self._fell_back(CONCURRENT, exc.kind)
            self._uncounted[key] = self._uncounted.get(key, 0) + 1
            return True
        except BaseException:
            abandoned = True
            raise
        if entered:
            self._held.setdefault(name, []).append(member)
        return entered

    def leave(self, key: str) -> None:
        """`LimitCounter.leave`: the place queued to be given back in Redis by the
        writer task (a place entered without Redis is given back here)."""
        try:
            uncounted = self._uncounted.get(key, 0)
            if uncounted:
                if uncounted > 1:
                    self._uncounted[key] = uncounted - 1
                else:
                    del self._uncounted[key]
                return
            name = self._prefix + key
            held = self._held.get(name)
            if not held:
                return  # more leaves than places entered: nothing to give back
            self._leaving.append((name, held.pop()))
            if not held:
                del self._held[name]
            self._writes.wake()
        except Exception as exc:  # it runs however a call ends: never raise
            log.warning("limit_counter_error", op="leave", error_type=type(exc).__name__)

    def _take_leaving(self) -> list[tuple[str, str]]:
        """The writer's next batch: every place queued (empty: none)."""
        batch, self._leaving = self._leaving, []
        return batch

    async def _give_back(self, batch: list[tuple[str, str]]) -> None:
        """One script call for `batch`; a batch not sent is counted (its places held in
        Redis until their lease runs out)."""
        try:
            await self.link.write(partial(self._send_leaves, batch=batch))
        except Unavailable as exc:
            self._fell_back(CONCURRENT, exc.kind, len(batch))
            raise

    async def _send_leaves(self, redis: Redis, *, batch: list[tuple[str, str]]) -> None:
        keys, members = zip(*batch, strict=True)
        await self._leave(keys=list(keys), args=list(members), client=redis)

    def _fell_back(self, limit: str, kind: str, calls: int = 1) -> None:
        """Counted, not logged: the breaker logs when Redis goes down and comes back."""
        self._errors.add(calls, {LIMIT: limit, ERROR_TYPE: kind})
