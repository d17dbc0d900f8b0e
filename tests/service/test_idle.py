"""An idle server sleeps: its event loop wakes for a health poll or a due probe, not on
timers a few times a second (a sidecar beside every pod pays for each wake-up)."""

from __future__ import annotations

import asyncio
from typing import Any

from rerank_client import Candidate

from tests.conftest import StartServer, client_of

DOCS = [
    Candidate(id="a", text="alpha document about cats"),
    Candidate(id="b", text="bravo document about dogs"),
    Candidate(id="c", text="charlie document about cats and dogs"),
]


class _CountingSelector:
    """The loop's selector, counting how often the loop waits for something."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.selects = 0

    def select(self, timeout: float | None = None) -> Any:
        self.selects += 1
        return self._inner.select(timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


async def test_an_idle_server_wakes_its_loop_rarely(start_server: StartServer) -> None:
    # Both edges and the monitor, as deployed; metrics on an ephemeral port. The health
    # poll (every 5 s by default, a handful of waits each) is put out of the window.
    server = await start_server(health_interval_s=60.0)
    async with client_of(server) as client:
        # A request reads the loop's lag: its sampler runs at the busy rate now.
        assert (await client.rerank("pets", DOCS, blend_strategy="rerank_only")).reranked
    loop = asyncio.get_running_loop()
    selector = _CountingSelector(loop._selector)  # type: ignore[attr-defined]
    loop._selector = selector  # type: ignore[attr-defined]
    try:
        await asyncio.sleep(2.5)  # the lag sampler slows down 2 s after the last read
        before = selector.selects
        await asyncio.sleep(3.0)
        woke = selector.selects - before
    finally:
        loop._selector = selector._inner  # type: ignore[attr-defined]
    # Before: the lag sampler (20 a second), uvicorn's tick (10) and the monitor's (4):
    # 159 waits in 3 s (each timer's wake-up is two). Now: the idle lag sampler twice a
    # second and uvicorn's tick once, 12-14.
    assert woke <= 25, f"the idle loop waited {woke} times in 3 s"
    # A request after the pause is served as before.
    async with client_of(server) as client:
        assert (await client.rerank("pets", DOCS, blend_strategy="rerank_only")).reranked
