"""Event loop choice: uvloop when it is installed and works, plain asyncio otherwise."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


def loop_factory(use_uvloop: bool = True) -> Callable[[], asyncio.AbstractEventLoop]:
    """For `asyncio.Runner(loop_factory=...)`, not a global policy: importing this
    package changes nothing for the host program (as uvicorn's loops/auto.py)."""
    if use_uvloop:
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.new_event_loop
    return asyncio.new_event_loop
