"""The loop-lag sampler: it measures a blocked loop, and sleeps while nobody reads it."""

from __future__ import annotations

import asyncio
import time

import pytest

from rerank_server.observability import loop_lag
from rerank_server.observability.loop_lag import LoopLag


def _block_the_loop(seconds: float) -> None:
    """What a long synchronous step does to the loop: nothing else runs meanwhile."""
    time.sleep(seconds)


@pytest.fixture(autouse=True)
def fast_sampler(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loop_lag, "INTERVAL_S", 0.01)
    monkeypatch.setattr(loop_lag, "WINDOW", 5)


async def test_a_blocked_loop_shows_as_lag_and_an_unread_sampler_sleeps() -> None:
    lag = LoopLag()
    lag.start()
    try:
        await asyncio.sleep(0.015)  # the first sample's timer is armed
        _block_the_loop(0.1)  # the loop cannot run the timer for 100 ms
        await asyncio.sleep(0.001)
        assert lag.recent_s >= 0.05
        # Five samples with no read in between: the sampler forgets them and sleeps.
        await asyncio.sleep(0.2)
        assert not lag.sampling
        assert lag.recent_s == 0.0  # a loop with nothing to do has no lag
        # That read woke it: samples resume, and a new block is seen again.
        assert lag.sampling
        await asyncio.sleep(0.015)
        _block_the_loop(0.1)
        await asyncio.sleep(0.001)
        assert lag.recent_s >= 0.05
    finally:
        await lag.stop()
