"""The loop-lag sampler: it measures a blocked loop, slows down while nobody reads it,
and still sees a loop that fell behind before the first read after a pause."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from rerank_server.observability import loop_lag
from rerank_server.observability.loop_lag import LoopLag


def _block_the_loop(seconds: float) -> None:
    """What a long synchronous step does to the loop: nothing else runs meanwhile."""
    time.sleep(seconds)


@pytest.fixture
async def lag(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[LoopLag]:
    """A started sampler, ten times faster than the server's."""
    monkeypatch.setattr(loop_lag, "INTERVAL_S", 0.01)
    monkeypatch.setattr(loop_lag, "IDLE_INTERVAL_S", 0.04)
    monkeypatch.setattr(loop_lag, "WINDOW_S", 0.2)
    sampler = LoopLag()
    sampler.start()
    yield sampler
    await sampler.stop()


async def test_a_blocked_loop_shows_as_lag_for_the_window(lag: LoopLag) -> None:
    assert lag.recent_s == 0.0  # nothing sampled yet
    await asyncio.sleep(0.015)  # a sample's timer is armed, due within 10 ms
    _block_the_loop(0.15)  # the loop cannot run it for 150 ms: at least 140 ms late
    await asyncio.sleep(0.001)
    assert lag.recent_s >= 0.12
    await asyncio.sleep(0.3)  # longer than the window: the late sample is forgotten
    assert lag.recent_s < 0.1


async def test_unread_it_samples_rarely_and_still_sees_a_late_loop(lag: LoopLag) -> None:
    lag.recent_s  # noqa: B018  a read: the sampler runs at its busy rate
    assert not lag.idle
    await asyncio.sleep(0.3)  # no read for longer than the window
    assert lag.idle
    # The loop falls behind while nothing reads the lag (a neighbour on the cores): the
    # first read after the pause sees it.
    await asyncio.sleep(0.01)
    _block_the_loop(0.15)  # the idle sample's timer is due within 40 ms
    await asyncio.sleep(0.001)
    assert lag.recent_s >= 0.1
    assert not lag.idle  # that read put it back to its busy rate


async def test_the_idle_rate_is_the_idle_interval(lag: LoopLag) -> None:
    await asyncio.sleep(0.5)  # never read: idle from the start
    taken = len(lag._samples)  # samples of the last window (0.2 s)
    assert taken <= 0.2 / 0.04 + 1  # not 0.2 / 0.01 = 20
