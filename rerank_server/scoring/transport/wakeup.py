"""`Wakeup`: one coroutine at a time waiting for "something happened".

The lean transport's connections (bytes in, the peer closed) and `score_within`'s inbox
(an outcome in, the scorer ended, shutdown) wait this way: event-loop callbacks call
`wake`, and a timer calls `expire`, which also marks the wait as timed out. A future per
wait is cheaper than an `asyncio.Event` plus `asyncio.timeout`, and the expiry is a flag
rather than a second look at the clock: uvloop rounds timers to the millisecond, so one
may fire a little before its deadline, and a waiter that re-read the clock would wait
again, in zero-length timers, until the clock caught up.
"""

from __future__ import annotations

import asyncio


class Wakeup:
    def __init__(self) -> None:
        self.expired = False
        self._waiter: asyncio.Future[None] | None = None

    def wake(self, *_: object) -> None:
        """Wake the waiter, if any (also usable as a done callback)."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def expire(self) -> None:
        """The timeout ran out: mark it, and wake the waiter."""
        self.expired = True
        self.wake()

    async def wait(self) -> None:
        """Until `wake` or `expire` is called."""
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
