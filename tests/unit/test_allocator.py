"""Freed memory is given back to the system (`rerank_server/allocator.py`): a trim soon
after a burst's large frees, at most one an interval, one more after the burst's tail,
none for small change."""

from __future__ import annotations

import asyncio

from rerank_server.allocator import MemoryReturn
from tests.waiting import eventually

MiB = 1024 * 1024


def counting() -> tuple[MemoryReturn, list[int]]:
    calls: list[int] = []

    def trim(pad: int) -> int:
        calls.append(pad)
        return 1

    return MemoryReturn(every_bytes=16 * MiB, tail_bytes=MiB, min_interval_s=0.2, trim=trim), calls


async def test_a_burst_is_trimmed_at_once_then_at_most_once_an_interval() -> None:
    memory, calls = counting()
    memory.freed(20 * MiB)
    assert await eventually(lambda: memory.trims == 1, 2)
    for _ in range(10):  # more large frees within the interval: one more trim, later
        memory.freed(20 * MiB)
    await asyncio.sleep(0.05)
    assert memory.trims == 1
    assert await eventually(lambda: memory.trims == 2, 2)
    await asyncio.sleep(0.5)
    assert calls == [0, 0]


async def test_the_tail_of_a_burst_is_trimmed_within_the_interval() -> None:
    memory, calls = counting()
    memory.freed(2 * MiB)  # under the burst threshold, over the tail's
    await asyncio.sleep(0.1)
    assert calls == []
    assert await eventually(lambda: memory.trims == 1, 2)


async def test_small_frees_cost_nothing() -> None:
    memory, calls = counting()
    for _ in range(100):
        memory.freed(4096)  # 400 KiB in all
    await asyncio.sleep(0.4)
    assert calls == []


def test_without_glibc_nothing_is_done() -> None:
    memory = MemoryReturn(trim=None)
    memory._trim = None  # as on musl or macOS: `malloc_trim` not found
    memory.freed(100 * MiB)  # no loop needed: returns before scheduling
    assert memory.trims == 0
