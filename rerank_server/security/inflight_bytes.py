"""The bytes of requests in flight, server-wide, against `--max-inflight-bytes`, over both
edges (docs/architecture.md, "The byte budget").
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from dataclasses import dataclass, field


class Overloaded(Exception):
    """The server-wide budget for request bytes in flight is spent."""


@dataclass(eq=False)
class _Waiter:
    """A `hold` waiting for room."""

    size: int
    patient: bool  # waits for room rather than being refused
    granted: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class InflightBytes:
    """The bytes of requests in flight against a server-wide budget: requests being worked
    on, bodies arriving, and room held for messages being read. A request larger than
    the whole budget is still taken when nothing else is in flight."""

    def __init__(self, limit: int, released: Callable[[int], None] | None = None) -> None:
        self.limit = limit
        self.used = 0  # all of it: bytes in hand and room held
        self.held = 0  # of `used`: room held for messages being read (`hold`)
        self._released = released  # told of every size of real bytes given back
        self._waiting: collections.deque[_Waiter] = collections.deque()

    def take(self, size: int, own: int = 0) -> None:
        """Count `size` more bytes in hand; `own` of those in flight are the same
        request's (taken as its body arrived), so a request alone may still exceed the
        budget. Overloaded when there is no room now."""
        if self.used + size > self.limit and self.used > own:
            raise self._refusal()
        self.used += size

    async def hold(self, size: int, patient: bool = False) -> None:
        """Hold room for a message of at most `size` bytes before reading it; then
        `settle` it with its real size, or `release` it. Waits while room held for
        other messages is in the way; Overloaded when the bytes in hand leave no room,
        unless `patient` (a batch stream, whose next request can wait its turn)."""
        waiter = _Waiter(size, patient)
        if self._fits(waiter):
            self._grant(waiter)
            return
        if self._hopeless(waiter):
            raise self._refusal()
        self._waiting.append(waiter)
        try:
            await waiter.granted
        except asyncio.CancelledError:
            granted = waiter.granted
            if granted.done() and not granted.cancelled():
                if granted.exception() is None:  # granted as it was cancelled: undone
                    self.release(size)
            elif waiter in self._waiting:  # a wake in between may have dropped it
                self._waiting.remove(waiter)
            raise

    def settle(self, held: int, size: int) -> None:
        """The message `held` was held for has arrived, `size` bytes: they count instead
        (never refused: the room was held for the largest message allowed)."""
        self.held -= held
        self.used += size - held
        self._wake()

    def release(self, held: int) -> None:
        """Room held for a message that did not come (or is no longer waited for)."""
        self.held -= held
        self.used -= held
        self._wake()

    def give_back(self, size: int) -> None:
        self.used -= size
        if self._released is not None:
            self._released(size)
        self._wake()

    def _fits(self, waiter: _Waiter) -> bool:
        return self.used + waiter.size <= self.limit or self.used == 0

    def _hopeless(self, waiter: _Waiter) -> bool:
        """No room even once every message being read has arrived and counted as
        nothing: the bytes in hand alone leave none."""
        in_hand = self.used - self.held
        return not waiter.patient and in_hand + waiter.size > self.limit and in_hand > 0

    def _grant(self, waiter: _Waiter) -> None:
        self.used += waiter.size
        self.held += waiter.size

    def _refusal(self) -> Overloaded:
        return Overloaded(
            f"server busy: {(self.used - self.held) // 1024} KiB of requests in progress "
            f"(max_inflight_bytes {self.limit // 1024} KiB); retry with backoff"
        )

    def _wake(self) -> None:
        """Grant what fits now, in order of arrival; refuse what never will."""
        if not self._waiting:
            return
        still: collections.deque[_Waiter] = collections.deque()
        for waiter in self._waiting:
            if waiter.granted.done():
                continue
            if self._fits(waiter):
                self._grant(waiter)
                waiter.granted.set_result(None)
            elif self._hopeless(waiter):
                waiter.granted.set_exception(self._refusal())
            else:
                still.append(waiter)
        self._waiting = still
