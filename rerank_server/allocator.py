"""Giving freed memory back to the system after large requests (glibc's `malloc_trim`).

Why: docs/reliability.md, "Memory is bounded". Elsewhere (musl, macOS) nothing is done.
"""

from __future__ import annotations

import asyncio
import ctypes
import time
from collections.abc import Callable

MIN_INTERVAL_S = 1.0
EVERY_BYTES = 16 * 1024 * 1024  # freed request bytes that make a trim worth doing now
TAIL_BYTES = 1024 * 1024  # ... and worth doing within the interval


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


class MemoryReturn:
    """Counts freed request bytes (`freed`, from the event loop) and trims the heap.

    In a thread, at most once a `min_interval_s`: as soon as allowed once `every_bytes`
    were freed, and an interval later once `tail_bytes` were, so that a burst ends with
    a trim. glibc keeps what a burst freed; `malloc_trim(0)` gives it back.
    """

    def __init__(
        self,
        every_bytes: int = EVERY_BYTES,
        tail_bytes: int = TAIL_BYTES,
        min_interval_s: float = MIN_INTERVAL_S,
        trim: Callable[[int], int] | None = None,
    ) -> None:
        self._trim = trim if trim is not None else _malloc_trim()
        self._every = every_bytes
        self._tail = tail_bytes
        self._interval = min_interval_s
        self._freed = 0
        self._last = -min_interval_s
        self._scheduled = False
        self.trims = 0  # done so far: for tests and the log

    def freed(self, size: int) -> None:
        if self._trim is None:
            return
        self._freed += size
        if self._freed < self._tail or self._scheduled:
            return
        loop = asyncio.get_running_loop()
        self._scheduled = True
        soonest = self._last + self._interval
        at = soonest if self._freed >= self._every else time.monotonic() + self._interval
        loop.call_later(max(0.0, at - time.monotonic()), self._start, loop)

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._freed = 0
        self._last = time.monotonic()
        loop.run_in_executor(None, self._run).add_done_callback(self._done)

    def _run(self) -> None:
        assert self._trim is not None
        self._trim(0)

    def _done(self, _future: asyncio.Future[None]) -> None:
        self._scheduled = False
        self.trims += 1
        self.freed(0)  # more was freed while it ran: once more, as that asks
