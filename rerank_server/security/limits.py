"""Per-token limits: requests per second, pairs per minute, calls in progress, and the
priority that decides who is shed first when the server is full (docs/security.md,
"Per-token limits").

Counted through a `LimitCounter`: `LocalCounter`, this process's, by default; a counter
shared by replicas implements the same protocol. Both edges share one `Limiter` (the
`TokenSet`'s), so a token's limits hold over gRPC and JSON together.
"""

from __future__ import annotations

import contextvars
import enum
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from .inflight_bytes import Overloaded

# `Refusal.limit` and the metric's `rerank.limit`: the tokens file's own key names.
RPS = "rps"
PAIRS_PER_MINUTE = "pairs_per_minute"
CONCURRENT = "concurrent"
# A token over its concurrency is told to come back after this: when a place frees up
# is not known in advance.
CONCURRENT_RETRY_S = 1


class Priority(enum.Enum):
    """Who is shed first when the server's cap (`--max-concurrent-rpcs`) is nearly full."""

    HIGH = "high"
    NORMAL = "normal"
    LOW = "low"


# The share of the server's cap each priority may fill; `normal` leaves the rest to
# `high` only when some token is `high` (`places`).
LOW_SHARE = 0.5
NORMAL_SHARE = 0.8


def places(cap: int, high_reserved: bool) -> Mapping[Priority, int]:
    """How many of `cap` calls in progress each priority may be admitted below: a `low`
    flood cannot take more than half, a `normal` one leaves a fifth to `high` callers
    (when there are any). Never 0: an idle server admits anyone."""
    return {
        Priority.HIGH: cap,
        Priority.NORMAL: max(1, math.floor(cap * NORMAL_SHARE)) if high_reserved else cap,
        Priority.LOW: max(1, math.floor(cap * LOW_SHARE)),
    }


class Places:
    """One edge's cap on rerank calls in progress, shared out by priority (`places`):
    whether a caller may take one now, and why one was shed."""

    def __init__(self, cap: int, high_reserved: bool) -> None:
        self.cap = cap
        self.below = places(cap, high_reserved)
        self.active = 0

    def free(self, priority: Priority) -> bool:
        return self.active < self.below[priority]

    def take(self, priority: Priority) -> bool:
        """Take a place if this priority may: checked and taken with no await between."""
        if not self.free(priority):
            return False
        self.active += 1
        return True

    def leave(self) -> None:
        self.active -= 1

    def busy(self, priority: Priority, calls: str) -> str:
        """Why a call was shed: `calls` (as the edge names them) in progress, all there
        are, or all that this priority may take."""
        share = (
            f", all that {priority.value}-priority callers may take of {self.cap}"
            if self.below[priority] < self.cap
            else ""
        )
        return f"server busy: {self.active} {calls} in progress{share}"


@dataclass(frozen=True, slots=True)
class Limits:
    """One token's limits; None: not limited."""

    rps: int | None = None
    pairs_per_minute: int | None = None
    concurrent: int | None = None
    priority: Priority = Priority.NORMAL

    @property
    def counted(self) -> bool:
        """Whether any of the counted limits applies (priority aside)."""
        return (
            self.rps is not None or self.pairs_per_minute is not None or self.concurrent is not None
        )


@dataclass(frozen=True, slots=True)
class Caller:
    """Who a request comes from: an accepted token's name (never the token) and limits."""

    name: str
    limits: Limits = Limits()


# Every request when authentication is off: no name, no limits, normal priority.
ANONYMOUS = Caller("")


@dataclass(frozen=True, slots=True)
class Refusal:
    """A request refused because its token is over `limit` (a key of the tokens file)."""

    caller: str
    limit: str
    message: str  # names the token's name and the limit, never the token
    retry_after_s: int  # whole seconds, at least 1


class LimitExceeded(Overloaded):
    """A refusal raised where a handler finds it (pairs, counted once the message is
    read): RESOURCE_EXHAUSTED, like the server's own overload."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.message)
        self.refusal = refusal


class LimitCounter(Protocol):
    """Where the limits are counted. Keys are `NAME:LIMIT` (`svc-a:rps`); one counter
    serves every token. A shared implementation (replicas counting together) must keep
    each method atomic per key."""

    async def take(self, key: str, amount: int, limit: int, window_s: float) -> float:
        """Count `amount` against at most `limit` per `window_s` under `key`. 0.0 when
        counted; else the seconds until it could be, and nothing is counted. An `amount`
        over `limit` is counted when nothing else is (so it passes, alone, rather than
        never)."""
        ...

    async def enter(self, key: str, limit: int) -> bool:
        """One more in progress under `key` if fewer than `limit` are; whether it was."""
        ...

    def leave(self, key: str) -> None:
        """One fewer in progress under `key` (after an `enter` that returned True). Never
        waits and never raises: it runs on every way a call ends, cancellation included."""
        ...


class LocalCounter:
    """This process's counts: a token bucket per rate key (it holds `limit`, refills
    `limit` per `window_s`, may go into debt by one oversized `amount`), a count per
    concurrency key."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # key: (level, when)
        self._inside: dict[str, int] = {}

    async def take(self, key: str, amount: int, limit: int, window_s: float) -> float:
        now = self._clock()
        rate = limit / window_s
        level, when = self._buckets.get(key, (float(limit), now))
        level = min(float(limit), level + (now - when) * rate)
        needed = min(amount, limit)
        if level < needed:
            self._buckets[key] = (level, now)
            return (needed - level) / rate
        self._buckets[key] = (level - amount, now)
        return 0.0

    async def enter(self, key: str, limit: int) -> bool:
        inside = self._inside.get(key, 0)
        if inside >= limit:
            return False
        self._inside[key] = inside + 1
        return True

    def leave(self, key: str) -> None:
        inside = self._inside.get(key, 0) - 1
        if inside > 0:
            self._inside[key] = inside
        else:
            self._inside.pop(key, None)

    def inside(self, key: str) -> int:
        """Calls in progress under `key` (tests, and what a metric could read)."""
        return self._inside.get(key, 0)


class Admission:
    """A call admitted under its caller's limits: it holds a concurrency place (when the
    token has that limit) until `release`, and is charged its pairs once they are known.

    `on_refusal`: what the edge does when a later charge is refused (the gRPC edge sets
    the call's retry trailers and counts it)."""

    __slots__ = ("_counter", "_entered", "caller", "on_refusal")

    def __init__(self, counter: LimitCounter, caller: Caller, entered: bool) -> None:
        self._counter = counter
        self._entered = entered
        self.caller = caller
        self.on_refusal: Callable[[Refusal], None] | None = None

    async def charge_pairs(self, count: int) -> Refusal | None:
        """Count `count` pairs against the token's pairs per minute; the refusal when the
        request would pass it."""
        limit = self.caller.limits.pairs_per_minute
        if limit is None or count <= 0:
            return None
        name = self.caller.name
        wait = await self._counter.take(f"{name}:{PAIRS_PER_MINUTE}", count, limit, 60.0)
        if not wait:
            return None
        after = _whole_seconds(wait)
        return Refusal(
            name,
            PAIRS_PER_MINUTE,
            f"token '{name}' is over its limit of {limit} pairs per minute (this request "
            f"has {count}); retry after {after} s",
            after,
        )

    def release(self) -> None:
        """Give the concurrency place back; once, however often it is called."""
        if self._entered:
            self._entered = False
            self._counter.leave(f"{self.caller.name}:{CONCURRENT}")


class Limiter:
    """Admits a caller's calls under its limits, through one `LimitCounter`."""

    def __init__(self, counter: LimitCounter | None = None) -> None:
        self.counter: LimitCounter = counter or LocalCounter()

    async def admit(self, caller: Caller) -> Admission | Refusal:
        """Concurrency first (a place taken), then the request rate (a request refused
        for its rate gives the place back at once). A request admitted here and refused
        later (the server's cap, its pairs) has counted against the rate."""
        limits, name = caller.limits, caller.name
        entered = False
        if limits.concurrent is not None:
            if not await self.counter.enter(f"{name}:{CONCURRENT}", limits.concurrent):
                return Refusal(
                    name,
                    CONCURRENT,
                    f"token '{name}' is over its limit of {limits.concurrent} concurrent "
                    f"requests; retry after {CONCURRENT_RETRY_S} s",
                    CONCURRENT_RETRY_S,
                )
            entered = True
        admission = Admission(self.counter, caller, entered)
        if limits.rps is not None:
            try:
                wait = await self.counter.take(f"{name}:{RPS}", 1, limits.rps, 1.0)
            except BaseException:
                admission.release()
                raise
            if wait:
                admission.release()
                after = _whole_seconds(wait)
                return Refusal(
                    name,
                    RPS,
                    f"token '{name}' is over its limit of {limits.rps} requests per second; "
                    f"retry after {after} s",
                    after,
                )
        return admission


def _whole_seconds(wait: float) -> int:
    """`Retry-After` in whole seconds, at least 1 (HTTP's header has no fractions; the
    gRPC edge says the same, so both edges tell a caller alike)."""
    return max(1, math.ceil(wait))


# The gRPC call's admission, for the handler that reads the message and so learns its
# pairs (`charge_pairs`). Set by the interceptor, in the call's task.
current: contextvars.ContextVar[Admission | None] = contextvars.ContextVar(
    "rerank_limits_admission", default=None
)


async def charge_pairs(count: int) -> None:
    """Charge the current call's `count` pairs; LimitExceeded (after its admission's
    `on_refusal`) when its token is over its pairs per minute. Nothing without limits."""
    admission = current.get()
    if admission is None:
        return
    refusal = await admission.charge_pairs(count)
    if refusal is not None:
        if admission.on_refusal is not None:
            admission.on_refusal(refusal)
        raise LimitExceeded(refusal)
