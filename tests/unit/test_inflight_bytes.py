"""The in-flight byte budget (`security/inflight_bytes.py`): room held for gRPC messages
before they are read, bytes counted as JSON bodies arrive, who waits and who is refused."""

from __future__ import annotations

import asyncio

import pytest

from rerank_server.security.inflight_bytes import InflightBytes, Overloaded

MIB = 2**20


async def test_room_for_a_message_is_held_then_settled_at_its_real_size() -> None:
    budget = InflightBytes(64 * MIB)
    await budget.hold(4 * MIB)
    assert (budget.used, budget.held) == (4 * MIB, 4 * MIB)
    budget.settle(4 * MIB, 1000)
    assert (budget.used, budget.held) == (1000, 0)
    budget.give_back(1000)
    assert budget.used == 0


async def test_a_call_the_bytes_in_hand_leave_no_room_for_is_refused_at_once() -> None:
    budget = InflightBytes(10 * MIB)
    budget.take(7 * MIB)  # being worked on
    with pytest.raises(Overloaded, match="retry with backoff"):
        await budget.hold(4 * MIB)
    assert (budget.used, budget.held) == (7 * MIB, 0)


async def test_a_call_waits_while_room_is_held_for_messages_being_read() -> None:
    """A burst of calls is not refused for room that messages still being read hold:
    each waits, and gets room as those arrive (at their real, smaller size)."""
    budget = InflightBytes(9 * MIB)
    await budget.hold(4 * MIB)
    await budget.hold(4 * MIB)
    third = asyncio.ensure_future(budget.hold(4 * MIB))
    await asyncio.sleep(0)
    assert not third.done()
    budget.settle(4 * MIB, 1000)  # the first message was small
    await asyncio.wait_for(third, 1)
    assert (budget.used, budget.held) == (8 * MIB + 1000, 8 * MIB)


async def test_a_waiting_call_is_refused_once_the_messages_read_leave_no_room() -> None:
    budget = InflightBytes(8 * MIB)
    await budget.hold(4 * MIB)
    await budget.hold(4 * MIB)
    third = asyncio.ensure_future(budget.hold(4 * MIB))
    await asyncio.sleep(0)
    budget.settle(4 * MIB, 4 * MIB)
    budget.settle(4 * MIB, 4 * MIB)  # two maximal messages: 8 MiB in hand
    with pytest.raises(Overloaded):
        await asyncio.wait_for(third, 1)
    assert (budget.used, budget.held) == (8 * MIB, 0)


async def test_a_patient_hold_waits_for_work_to_end_rather_than_being_refused() -> None:
    budget = InflightBytes(8 * MIB)
    budget.take(6 * MIB)
    patient = asyncio.ensure_future(budget.hold(4 * MIB, patient=True))
    await asyncio.sleep(0)
    assert not patient.done()
    budget.give_back(6 * MIB)
    await asyncio.wait_for(patient, 1)
    assert budget.held == 4 * MIB


async def test_a_json_chunk_is_refused_while_held_room_fills_the_budget() -> None:
    """A JSON body never waits: its connection would read on meanwhile, uncounted."""
    budget = InflightBytes(8 * MIB)
    await budget.hold(8 * MIB)
    with pytest.raises(Overloaded):
        budget.take(64 * 1024)
    budget.release(8 * MIB)
    budget.take(64 * 1024)
    assert budget.used == 64 * 1024


async def test_a_message_larger_than_the_budget_is_read_when_nothing_else_is() -> None:
    budget = InflightBytes(1 * MIB)
    await budget.hold(1 * MIB)
    budget.settle(1 * MIB, 3 * MIB)
    assert budget.used == 3 * MIB
    with pytest.raises(Overloaded):
        await budget.hold(1 * MIB)


async def test_a_cancelled_wait_leaves_nothing_held() -> None:
    budget = InflightBytes(4 * MIB)
    await budget.hold(4 * MIB)
    waiting = asyncio.ensure_future(budget.hold(4 * MIB))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    budget.release(4 * MIB)
    assert (budget.used, budget.held) == (0, 0)
    # Granted and cancelled in the same turn: the grant is undone.
    await budget.hold(4 * MIB)
    granted = asyncio.ensure_future(budget.hold(4 * MIB))
    await asyncio.sleep(0)
    budget.release(4 * MIB)  # grants the waiter
    granted.cancel()
    with pytest.raises(asyncio.CancelledError):
        await granted
    assert (budget.used, budget.held) == (0, 0)
