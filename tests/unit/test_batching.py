"""`map_pairs`: one task per pair, every outcome emitted once, a crash raised, and the
pairs still running let go when it stops (nothing left registered)."""

from __future__ import annotations

import asyncio

import pytest
import structlog

from rerank_server.scoring.backends import prompt
from rerank_server.scoring.backends.batching import map_pairs
from rerank_server.scoring.base import PairOutcome
from rerank_server.scoring.calls import CallTasks
from rerank_server.scoring.transport import backend as http
from tests.fakes.llama import FakeLlamaServer
from tests.waiting import eventually

CALLS = CallTasks()  # the registry every test here hands map_pairs


def _tracked() -> list[object]:
    return CALLS.held()


async def test_every_pair_is_emitted_once_in_its_own_task() -> None:
    emitted: list[PairOutcome] = []
    tasks: set[asyncio.Task[object] | None] = set()

    async def one(i: int) -> PairOutcome:
        tasks.add(asyncio.current_task())
        await asyncio.sleep(0.02 * (5 - i))  # they land out of order (20 ms apart: a
        # preempted process once started two tasks more than 1 ms apart)
        return PairOutcome(i, i / 10)

    await map_pairs(5, one, emitted.append, CALLS)
    assert sorted(o.pair for o in emitted) == [0, 1, 2, 3, 4]
    assert [o.pair for o in emitted] == [4, 3, 2, 1, 0]
    assert len(tasks) == 5
    assert not _tracked()


async def _waits_long(i: int, cancelled: list[int]) -> PairOutcome:
    """A pair whose answer takes 10 s; notes when it is cancelled."""
    try:
        await asyncio.sleep(10)
    except asyncio.CancelledError:
        cancelled.append(i)
        raise
    return PairOutcome(i, 0.5)


async def test_a_crashing_pair_raises_and_the_rest_are_let_go() -> None:
    started: list[int] = []
    cancelled: list[int] = []

    async def one(i: int) -> PairOutcome:
        started.append(i)
        if i == 1:
            raise ValueError("a bug")
        return await _waits_long(i, cancelled)

    with pytest.raises(ValueError):
        await map_pairs(3, one, lambda _o: None, CALLS)
    await asyncio.sleep(0)
    assert started == [0, 1, 2] and sorted(cancelled) == [0, 2]
    assert not _tracked()


async def test_stopping_cancels_pairs_with_nothing_on_the_wire() -> None:
    cancelled: list[int] = []
    scorer = asyncio.create_task(
        map_pairs(4, lambda i: _waits_long(i, cancelled), lambda _o: None, CALLS)
    )
    await asyncio.sleep(0.01)
    scorer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await scorer
    await asyncio.sleep(0)
    assert sorted(cancelled) == [0, 1, 2, 3]
    assert not _tracked()


async def test_a_pair_let_go_on_the_wire_stops_when_its_call_returns(
    fake_llama: FakeLlamaServer,
) -> None:
    """A pair still running after its request stopped waiting (its call was on the wire,
    so it was abandoned) stops when the call comes back within the leash: it emits
    nothing to a request that is gone, so nothing of it can crash unheard either."""
    fake_llama.latency_s = 0.3
    backend = http.HttpBackend(fake_llama.url, 2, 5.0, calls=CALLS)
    body = {
        "messages": [
            {"role": "system", "content": prompt.SYSTEM_PROMPT},
            {"role": "user", "content": prompt.user_message("i", "q", "d")},
        ],
        "max_tokens": 1,
        "logprobs": True,
        "top_logprobs": 20,
    }
    answered: list[int] = []

    async def one(i: int) -> PairOutcome:
        await backend.post_json("/v1/chat/completions", body)
        answered.append(i)
        return PairOutcome(i, 0.5)

    def emit(_outcome: PairOutcome) -> None:
        raise AssertionError("emitted to a request that is gone")

    scorer = asyncio.create_task(map_pairs(1, one, emit, CALLS))
    assert await eventually(lambda: fake_llama.in_flight == 1, 2)
    scorer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await scorer
    assert backend.abandoned == 1  # let go on the wire, not cancelled
    assert await eventually(lambda: backend.abandoned == 0, 3)
    await backend.aclose()
    assert answered == [] and len(fake_llama.requests) == 1 and not _tracked()


async def test_a_crash_after_another_pair_crashed_is_logged() -> None:
    """Two pairs crash in the same turn of the loop: the first is raised to the scorer,
    the second has nobody left to raise to and is logged, not lost."""

    async def one(i: int) -> PairOutcome:
        return PairOutcome(i, 0.5)

    def emit(_outcome: PairOutcome) -> None:
        raise ValueError("a bug")

    with structlog.testing.capture_logs() as logged, pytest.raises(ValueError):
        await map_pairs(2, one, emit, CALLS)
    assert [e["error"] for e in logged if e["event"] == "pair_crashed_unheard"] == ["ValueError"]
    assert not _tracked()
