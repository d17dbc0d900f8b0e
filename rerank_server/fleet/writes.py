"""Writes no request waits for: what a fleet module queued, sent by one background task
a batch at a time (the score cache's stores, the limit counter's give-backs).

The owner keeps its queue and says how a batch is taken from it and sent; a
`BackgroundWriter` runs one task while batches come, logs the writes Redis refused
(OOM, READONLY: answered, so the breaker does not count them) at most once a minute,
and at shutdown sends what is queued for a bounded time. Connection failures are the
breaker's to log (`redis_client.py`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import structlog

from .redis_client import OTHER, RedisLink, Unavailable, error_detail

log = structlog.get_logger(__name__)

B = TypeVar("B")

CLOSE_WAIT_S = 1.0  # for the queue to go out at shutdown
REFUSED_LOG_EVERY_S = 60.0


class BackgroundWriter(Generic[B]):
    """Sends `take()`'s batches with `send` from one task, until a batch is empty (falsy).

    `send` raises `Unavailable` for a batch not sent (as `RedisLink.write` does); a
    refused one is logged as `event` with `op`, the error's kind, class and Redis's
    words (never a key or a value), at most every REFUSED_LOG_EVERY_S.
    """

    def __init__(
        self,
        take: Callable[[], B],
        send: Callable[[B], Awaitable[object]],
        *,
        event: str,
        op: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._take = take
        self._send = send
        self._event = event
        self._op = op
        self._clock = clock
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._refused_logged = -REFUSED_LOG_EVERY_S

    def wake(self) -> None:
        """Start the task unless it runs (it takes what was queued before it ends).
        Needs the running loop; does nothing once closed."""
        if not self._closed and self._running() is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def flush(self) -> None:
        """Wait until what was queued so far was sent (or failed to be)."""
        while (task := self._running()) is not None:
            await asyncio.wait((task,))  # not shielded: a cancelled task ends a flush too

    async def aclose(self) -> None:
        """Send what is queued for up to CLOSE_WAIT_S, a task started meanwhile included,
        then cancel the task (the batch it holds and the rest of the queue with it);
        start none after."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CLOSE_WAIT_S
        try:
            while (task := self._running()) is not None:
                await asyncio.wait((task,), timeout=max(0.0, deadline - loop.time()))
                if not task.done():
                    break
        finally:
            self._closed = True
            if (task := self._running()) is not None:
                task.cancel()
                await asyncio.wait((task,))

    def _running(self) -> asyncio.Task[None] | None:
        # A task cancelled before its first step never ran `_run`'s `finally`.
        task = self._task
        return task if task is not None and not task.done() else None

    async def _run(self) -> None:
        try:
            while batch := self._take():
                try:
                    await self._send(batch)
                except Unavailable as exc:
                    if exc.answered:
                        self._refused(exc)
        except Exception as exc:  # the owner's take or send failing: what is queued waits
            log.warning(self._event, op=self._op, error=OTHER, error_type=type(exc).__name__)
        finally:
            # Here, not in a done callback: a batch queued after the last take must find
            # no task and start one.
            self._task = None

    def _refused(self, exc: Unavailable) -> None:
        now = self._clock()
        if now - self._refused_logged >= REFUSED_LOG_EVERY_S:
            self._refused_logged = now
            cause = exc.__cause__
            log.warning(
                self._event,
                op=self._op,
                error=exc.kind,
                error_type=type(cause).__name__,
                detail=error_detail(cause),
            )


class WritingClient:
    """What a fleet client over a `RedisLink` with queued writes closes alike: the
    queue is sent (for up to `CLOSE_WAIT_S`), then the connections closed."""

    link: RedisLink
    _writes: BackgroundWriter[Any]

    async def flush(self) -> None:
        """Wait until what was queued so far was sent (or failed to be)."""
        await self._writes.flush()

    async def aclose(self) -> None:
        try:
            await self._writes.aclose()
        finally:
            await self.link.aclose()
