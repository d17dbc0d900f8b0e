"""`Wakeup`: one coroutine at a time waiting for "something happened"."""

from __future__ import annotations

import asyncio


class Wakeup:
    """One waiter, woken by event-loop callbacks (`wake`) and expired by a timer (`expire`).

    A future per wait costs less than an `asyncio.Event` plus `asyncio.timeout`.
    """

    def __init__(self) -> None:
        self.expired = False
        self._waiter: asyncio.Future[None] | None = None

    def wake(self, *_: object) -> None:
        """Wake the waiter, if any (also usable as a done callback)."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def expire(self) -> None:
        """The timeout ran out: mark it, and wake the waiter.

        The mark, not a second look at the clock, says the wait timed out: uvloop rounds
        timers to the millisecond, so one may fire a little before its deadline, and a
        waiter that re-read the clock would wait again in zero-length timers.
        """
        self.expired = True
        self.wake()

    async def wait(self) -> None:
        """Until `wake` or `expire` is called."""
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
