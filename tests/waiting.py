"""Waiting for a condition in tests, with a bound: loopback is fast, not instant."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable


async def eventually(
    condition: Callable[[], bool | Awaitable[bool]], timeout_s: float, poll_s: float = 0.05
) -> bool:
    """Whether `condition` held within `timeout_s` (checked every `poll_s`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = condition()
        if inspect.isawaitable(held):
            held = await held
        if held or time.monotonic() >= deadline:
            return bool(held)
        await asyncio.sleep(poll_s)
