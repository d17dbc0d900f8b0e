"""Event-loop lag: how late the loop runs a callback it was asked to run on time.

On a busy 2-core machine the loop can fall hundreds of milliseconds behind. A request's
time budget keeps back a reserve for blending and sending its answer; `LoopLag.recent_s`
lets that reserve grow with the lag, so an admitted request is still answered before its
deadline when the loop is slow.
"""

from __future__ import annotations

import asyncio
import collections

INTERVAL_S = 0.05
WINDOW = 40  # samples: the largest lag of about the last 2 s


class LoopLag:
    """Samples the loop's lag every `INTERVAL_S` while started."""

    def __init__(self) -> None:
        self._samples: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self._task: asyncio.Task[None] | None = None

    @property
    def recent_s(self) -> float:
        """The largest lag seen recently (0 before the first sample)."""
        return max(self._samples, default=0.0)

    def start(self) -> None:
        self._task = asyncio.create_task(self._sample())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _sample(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + INTERVAL_S
            await asyncio.sleep(INTERVAL_S)
            self._samples.append(max(0.0, loop.time() - due))
