"""The fleet's Redis (or Valkey): one client made from `--cache-url`, asked within
bounds, behind a circuit breaker.

`RedisLink.read` waits for a call at most the caller's bound; a call that takes longer
runs on in the background (cancelling it would cost its connection) until its socket
timeout, a bounded number at a time. `RedisLink.write` is for background work. After
`FAILURES_TO_OPEN` failed calls in a row the `Breaker` opens: nothing is asked until a
probe, one at a time, after a back-off of 1 s doubling to 30 s, finds Redis answering.
Each change is logged once (`<event>_down`, `<event>_up`), with the error's kind and
class, never a key or a value.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import structlog
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import (
    AuthenticationError,
    AuthorizationError,
    BusyLoadingError,
    InvalidResponse,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..errors import ConfigError

log = structlog.get_logger(__name__)

T = TypeVar("T")
Call = Callable[[Redis], Awaitable[T]]

FAILURES_TO_OPEN = 3
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
# How long a call may take once nobody waits for it (a read past its caller's bound, a
# background write, a probe), and a connection to be made: it holds a connection
# meanwhile, so it must end, but it is no request's delay.
SOCKET_TIMEOUT_S = 1.0
# Reads in flight at most, a request's or one left running past its bound: past it a
# lookup is a miss without asking (BUSY), so a burst of requests, or a Redis slow for
# some calls and not others, holds at most this many connections.
MAX_PENDING_READS = 32

DETAIL_CHARS = 200  # of an error's text in a log line

# Error kinds, as metrics and logs name them.
TIMEOUT = "timeout"  # no answer within the bound
CONNECTION = "connection"  # refused, reset, closed, unresolvable, TLS failed
REFUSED = "refused"  # Redis answered no: auth, ACL, OOM, READONLY, loading
OTHER = "error"
# Why a call was not sent (no round trip, nothing counted against Redis).
DOWN = "down"  # the breaker is open
BUSY = "busy"  # MAX_PENDING_READS reads in flight already


class Unavailable(Exception):
    """A call that did not answer: `kind` is one of the kinds above; `answered` when
    Redis answered the command itself with an error (OOM, READONLY, NOPERM), as
    opposed to failing the connection (reset, timeout, a wrong password)."""

    def __init__(self, kind: str, answered: bool = False) -> None:
        super().__init__(kind)
        self.kind = kind
        self.answered = answered


def error_kind(error: BaseException) -> str:
    """TIMEOUT, CONNECTION, REFUSED or OTHER for an error a call raised."""
    if isinstance(error, RedisTimeoutError | TimeoutError):
        return TIMEOUT
    # Before CONNECTION: redis-py raises these as ConnectionError's subclasses.
    if isinstance(error, AuthenticationError | AuthorizationError | BusyLoadingError):
        return REFUSED
    if isinstance(error, ResponseError):  # OOM, READONLY, NOPERM, WRONGPASS, ...
        return REFUSED
    if isinstance(error, RedisConnectionError | InvalidResponse | OSError):
        return CONNECTION
    return OTHER


def error_detail(error: BaseException | None) -> str:
    """What Redis said in `error`, for a log line: at most DETAIL_CHARS, without the
    arguments an unknown command's reply quotes (keys, values)."""
    text = str(error) if error is not None else ""
    return text.partition(", with args beginning with")[0][:DETAIL_CHARS]


def client_from_url(url: str, tls_ca: str = "") -> Redis:
    """A client for `url` (redis:// or rediss://, user and password in it), verifying
    the server's certificate against `tls_ca` when given (else the system's CAs).

    No retries (a retry of a call already past its bound helps nobody; the breaker
    decides when to try again) and RESP2 (no HELLO per connection, nothing RESP3 adds
    is used). Connections are made when first needed. Raises ConfigError for a URL or
    CA that cannot work, never echoing the URL (it may hold a password).
    """
    scheme = urlsplit(url).scheme
    if scheme not in ("redis", "rediss"):
        raise ConfigError(
            "--cache-url / RERANK_CACHE_URL: expected redis://[USER:PASSWORD@]HOST:PORT/DB "
            f"or rediss://..., not a {scheme or 'schemeless'} URL"
        )
    options: dict[str, Any] = {
        "protocol": 2,
        "retry": Retry(NoBackoff(), 0),
        "socket_timeout": SOCKET_TIMEOUT_S,
        "socket_connect_timeout": SOCKET_TIMEOUT_S,
        "health_check_interval": 0,
        # The bounded reads, the writer, a probe: never reached.
        "max_connections": MAX_PENDING_READS + 8,
    }
    if tls_ca:
        if scheme != "rediss":
            raise ConfigError(
                "--cache-tls-ca / RERANK_CACHE_TLS_CA: only for a rediss:// --cache-url"
            )
        if not Path(tls_ca).is_file():
            raise ConfigError(f"--cache-tls-ca / RERANK_CACHE_TLS_CA: no file at {tls_ca}")
        options["ssl_ca_certs"] = tls_ca
    try:
        return Redis.from_url(url, **options)
    except ValueError:  # a port or db that is not a number, a bad query option
        # Not the library's message: it may quote a part of the URL, the password too.
        raise ConfigError(
            "--cache-url / RERANK_CACHE_URL: not a URL redis-py can read (its port or "
            "database is not a number, or a query option is unknown; a password with / "
            "or # in it must be percent-encoded)"
        ) from None


class Breaker:
    """Whether to ask Redis: up (closed) until `FAILURES_TO_OPEN` calls fail in a row,
    then down (open) until a probe succeeds. Probes are one at a time, each after a
    back-off that starts at `FIRST_BACKOFF_S` and doubles to `MAX_BACKOFF_S`; it
    starts again from the first only once a call succeeds, so a Redis that answers
    probes but fails requests is asked less and less often."""

    def __init__(self, event: str, clock: Callable[[], float] = time.monotonic) -> None:
        self._event = event
        self._clock = clock
        self.up = True
        self._failures = 0
        self._backoff_s = FIRST_BACKOFF_S
        self._retry_at = 0.0
        self._down_since = 0.0
        self._probing = False

    def succeeded(self) -> None:
        """A call answered in time."""
        if self.up:
            self._failures = 0
            self._backoff_s = FIRST_BACKOFF_S

    def failed(self, kind: str, error: BaseException) -> None:
        """A call failed; calls that end after the breaker opened are not counted."""
        if not self.up:
            return
        self._failures += 1
        if self._failures >= FAILURES_TO_OPEN:
            now = self._clock()
            self.up = False
            self._down_since = now
            log.warning(
                f"{self._event}_down",
                error=kind,
                error_type=type(error).__name__,
                failures=self._failures,
                retry_in_s=self._backoff_s,
            )
            self._wait(now)

    def probe_due(self) -> bool:
        """Whether to probe now; if so, the probe is taken (`probed` gives it back)."""
        if self.up or self._probing or self._clock() < self._retry_at:
            return False
        self._probing = True
        return True

    def probed(self, ok: bool) -> None:
        """A probe's outcome: up again, or a longer wait before the next."""
        self._probing = False
        now = self._clock()
        if not ok:
            self._wait(now)
            return
        self.up = True
        self._failures = 0
        log.info(f"{self._event}_up", down_s=round(now - self._down_since, 3))

    def _wait(self, now: float) -> None:
        self._retry_at = now + self._backoff_s
        self._backoff_s = min(self._backoff_s * 2, MAX_BACKOFF_S)


class RedisLink:
    """A Redis client and its breaker; what it starts in the background, it ends in
    `aclose`. `probe` is the call that tells whether Redis is back (the same kind of
    call as the reads, so that a user allowed PING but not the reads stays down)."""

    def __init__(
        self,
        client: Redis,
        breaker: Breaker,
        probe: Call[object],
        max_reads: int = MAX_PENDING_READS,
    ) -> None:
        self.client = client
        self.breaker = breaker
        self._probe = probe
        self._max_reads = max_reads
        self._running: set[asyncio.Future[Any]] = set()  # reads past their bound, probes
        self.reads = 0  # reads sent

    def usable(self) -> bool:
        """Whether the breaker lets calls through; if not, a probe starts when due."""
        if self.breaker.up:
            return True
        if self.breaker.probe_due():
            self._track(asyncio.get_running_loop().create_task(self._probe_once()))
        return False

    async def read(self, call: Call[T], wait_s: float) -> T:
        """`call`'s answer if it comes within `wait_s`, else Unavailable: the breaker is
        open (DOWN), too many reads still run (BUSY), or the call failed or took
        longer (the call then runs on, within SOCKET_TIMEOUT_S)."""
        if not self.usable():
            raise Unavailable(DOWN)
        if len(self._running) >= self._max_reads:
            raise Unavailable(BUSY)
        self.reads += 1
        task = self._track(asyncio.ensure_future(call(self.client)))
        done, _ = await asyncio.wait((task,), timeout=wait_s)
        if not done:
            self.breaker.failed(TIMEOUT, TimeoutError(f"no answer within {wait_s}s"))
            raise Unavailable(TIMEOUT)
        error = task.exception()
        if error is not None:
            kind = error_kind(error)
            self.breaker.failed(kind, error)
            raise Unavailable(kind) from error
        self.breaker.succeeded()
        return task.result()

    async def write(self, call: Call[T]) -> T:
        """`call`'s answer, waited for within SOCKET_TIMEOUT_S, for work no request
        waits on. A command Redis refused (OOM, READONLY) is raised but not counted
        against Redis: the reads may still be answered."""
        if not self.usable():
            raise Unavailable(DOWN)
        try:
            return await call(self.client)
        except ResponseError as exc:
            raise Unavailable(REFUSED, answered=True) from exc
        except Exception as exc:
            kind = error_kind(exc)
            self.breaker.failed(kind, exc)
            raise Unavailable(kind) from exc

    async def _probe_once(self) -> None:
        try:
            await asyncio.wait_for(self._probe(self.client), SOCKET_TIMEOUT_S * 2)
        except Exception:
            self.breaker.probed(ok=False)
        else:
            self.breaker.probed(ok=True)

    def _track(self, task: asyncio.Future[T]) -> asyncio.Future[T]:
        self._running.add(task)
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Future[Any]) -> None:
        self._running.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a late failure was counted, or is moot

    async def aclose(self) -> None:
        """Cancel what still runs and close the connections."""
        for task in list(self._running):
            task.cancel()
        if self._running:
            await asyncio.wait(list(self._running))
        await self.client.aclose()
