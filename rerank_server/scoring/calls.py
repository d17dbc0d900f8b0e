"""Tasks that make their backend calls themselves, and how they are let go."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

Task = asyncio.Task[Any]


class CallTasks:
    """The tasks registered with `own`, those of them with a call on the wire now (and
    how to abandon it), and those let go.

    Such a task (a per-pair scorer's pair, a scorer's own task) makes its call in its own
    task rather than in one behind a shield, so it cannot be shielded from its own
    cancellation: its canceller lets it go instead. One belongs to a backend pool and is
    shared by its instances, since a task's calls may go to any of them (`Scorer.calls`).
    """

    def __init__(self) -> None:
        self._own: set[Task] = set()
        self._on_wire: dict[Task, Callable[[Task], None]] = {}
        self._let_go: set[Task] = set()

    def own(self, task: Task) -> None:
        """`task` makes its calls itself from now until `done`; whoever would cancel it
        calls `let_go` instead."""
        self._own.add(task)

    def done(self, task: Task) -> None:
        self._own.discard(task)
        self._let_go.discard(task)

    def let_go(self, task: Task) -> None:
        """Stop waiting for `task`: cancel it unless its call is on the wire, else abandon
        that call (it may finish within the leash); either way it makes no further call."""
        if task.done() or task in self._let_go:
            return
        abandon = self._on_wire.get(task)
        if abandon is None:
            # Forgotten now: a task cancelled before its first step never runs the code
            # that would call `done`.
            self.done(task)
            task.cancel()
        else:
            self._let_go.add(task)
            abandon(task)

    def owns(self, task: Task | None) -> bool:
        return task in self._own

    def is_let_go(self, task: Task | None) -> bool:
        return task in self._let_go

    def on_wire(self, task: Task, abandon: Callable[[Task], None]) -> None:
        """`task`'s call is sent; `abandon` abandons it."""
        self._on_wire[task] = abandon

    def off_wire(self, task: Task) -> None:
        del self._on_wire[task]

    def held(self) -> list[Task]:
        """Every task still recorded: none once all calls and scorers have ended."""
        return [*self._own, *self._let_go, *self._on_wire]
