"""Event-loop lag: how late the loop runs a callback it was asked to run on time.

On a busy 2-core machine the loop can fall hundreds of milliseconds behind. A request's
time budget keeps back a reserve for blending and sending its answer; `LoopLag.recent_s`
lets that reserve grow with the lag, so an admitted request is still answered before its
deadline when the loop is slow.

Sampling costs a wake-up of the loop every `INTERVAL_S`, which an idle sidecar should not
pay for nothing (it was two thirds of an idle server's wake-ups). So the sampler runs
while the lag is being read: after `WINDOW` samples that no request read (about 2 s), it
forgets them and sleeps until the next read. The first request after such a pause sees a
lag of 0, which is what a loop with nothing to do has; samples resume at once.
"""

from __future__ import annotations

import asyncio
import collections

INTERVAL_S = 0.05
WINDOW = 40  # samples: the largest lag of about the last 2 s


class LoopLag:
    """Samples the loop's lag every `INTERVAL_S` while started and read."""

    def __init__(self) -> None:
        self._samples: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self._unread = 0  # samples taken since the last read
        self._read = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def recent_s(self) -> float:
        """The largest lag seen recently (0 before the first sample and after a pause)."""
        self._unread = 0
        if not self._read.is_set():
            self._read.set()
        return max(self._samples, default=0.0)

    @property
    def sampling(self) -> bool:
        """Whether the sampler is awake (False while it sleeps for want of readers)."""
        return self._read.is_set()

    def start(self) -> None:
        self._read.set()
        self._task = asyncio.create_task(self._sample())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _sample(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self._unread >= WINDOW:
                self._samples.clear()
                self._read.clear()
                await self._read.wait()
                self._unread = 0
            due = loop.time() + INTERVAL_S
            await asyncio.sleep(INTERVAL_S)
            self._samples.append(max(0.0, loop.time() - due))
            self._unread += 1
