"""Event-loop lag: how late the loop runs a callback it was asked to run on time.

A request's reserve for blending and sending grows with it (`LoopLag.recent_s`).
"""

from __future__ import annotations

import asyncio
import collections

INTERVAL_S = 0.05  # while requests come in
IDLE_INTERVAL_S = 0.5  # after WINDOW_S without one: still four samples in the window
WINDOW_S = 2.0  # the lag reported is the largest of this recent span


class LoopLag:
    """Samples the loop's lag while started: often while read, rarely while not.

    Every `INTERVAL_S` while requests read it, every `IDLE_INTERVAL_S` once none has for
    `WINDOW_S`: each sample wakes the loop, which an idle server should not pay often. It
    never stops, since the loop can fall behind while this server has nothing to do (a
    neighbour on the same cores), and the first request after a pause must see that.
    """

    def __init__(self) -> None:
        self._samples: collections.deque[tuple[float, float]] = collections.deque()
        self._read_at = float("-inf")  # loop time of the last read
        self._task: asyncio.Task[None] | None = None

    @property
    def recent_s(self) -> float:
        """The largest lag sampled in the last `WINDOW_S` (0 before the first sample)."""
        self._read_at = now = asyncio.get_running_loop().time()
        self._forget_before(now - WINDOW_S)
        return max((lag for _, lag in self._samples), default=0.0)

    @property
    def idle(self) -> bool:
        """Whether the sampler is at its idle rate (no read for `WINDOW_S`)."""
        return asyncio.get_running_loop().time() - self._read_at > WINDOW_S

    def start(self) -> None:
        self._task = asyncio.create_task(self._sample())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def _forget_before(self, cutoff: float) -> None:
        while self._samples and self._samples[0][0] < cutoff:
            self._samples.popleft()

    async def _sample(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            interval = IDLE_INTERVAL_S if self.idle else INTERVAL_S
            due = loop.time() + interval
            await asyncio.sleep(interval)
            now = loop.time()
            self._samples.append((now, max(0.0, now - due)))
            self._forget_before(now - WINDOW_S)
