"""How scorers fan a request's pairs out: one call per pair, or slices of `--max-batch`."""

from __future__ import annotations

import asyncio
import math
import traceback
from collections.abc import Awaitable, Callable, Mapping, Sequence

import structlog

from ..base import Emit, Failure, PairOutcome
from ..calls import CallTasks
from ..transport.errors import BackendCallError

log = structlog.get_logger(__name__)

SliceCall = Callable[[int, Sequence[str]], Awaitable[Mapping[int, float | None]]]
_new = tuple.__new__


async def score_in_batches(
    documents: Sequence[str],
    max_batch: int,
    call: SliceCall,
    emit: Emit,
    missing: str = "no score for this document",
    split_too_long: bool = False,
) -> None:
    """Score `documents` in slices of `max_batch`, emitting a slice's outcomes as it lands.

    `call(start, slice)` answers `{index within the slice: score | None}`. A slice whose
    call fails fails its pairs, and a pair the answer leaves out fails as malformed with
    the detail `missing`: nothing raises. With `split_too_long`, a slice refused as too
    long for the context is sent again as two halves, down to single documents, within
    `split_allowance` halvings (past them a refused half fails whole); only for a `call`
    that scores each document on its own (the slice's documents are not read together).
    """

    async def one(
        start: int,
        size: int = max_batch,
        splits: list[int] | None = None,
    ) -> None:
        chunk = documents[start : start + size]
        indexes = range(start, start + len(chunk))
        try:
            scores = await call(start, chunk)
        except BackendCallError as exc:
            if splits is None:  # a slice of its own: its allowance of halvings
                splits = [split_allowance(len(chunk))]
            if split_too_long and exc.too_long and len(chunk) > 1 and splits[0] > 0:
                splits[0] -= 1
                half = len(chunk) // 2
                await asyncio.gather(
                    one(start, half, splits), one(start + half, len(chunk) - half, splits)
                )
                return
            failed_all(indexes, exc, emit)
            return
        except Exception as exc:  # a bug in reading an answer: this slice's pairs fail,
            # not, through the task group, every other slice's (once all of a request's)
            # Frames without the message, which may quote the model's text.
            log.error(
                "slice_crashed",
                error=type(exc).__name__,
                stack="".join(traceback.format_list(traceback.extract_tb(exc.__traceback__))),
            )
            failed_all(
                indexes,
                BackendCallError(Failure.HTTP_ERROR, f"scorer crashed: {type(exc).__name__}"),
                emit,
            )
            return
        for offset, i in enumerate(indexes):
            score = scores.get(offset)
            if score is None:
                emit(PairOutcome.failed(i, Failure.MALFORMED, missing))
            else:
                # `PairOutcome(i, score)` without the named tuple's Python-level `__new__`
                # (every field given: `tuple.__new__` fills no default).
                emit(_new(PairOutcome, (i, score, None, "")))

    starts = range(0, len(documents), max_batch)
    if len(starts) == 1:  # one slice, the common case: no task group to run it in
        await one(0)
        return
    async with asyncio.TaskGroup() as group:
        for start in starts:
            group.create_task(one(start))


def split_allowance(n: int) -> int:
    """How many times a slice of `n` refused as too long may be halved: enough to find two
    documents at fault (each takes a halving per level), not the 2n - 1 calls of halving
    all the way down a slice a backend refuses whole, whatever it holds (a proxy's body
    limit below one document), on every request."""
    return 2 * max(n - 1, 0).bit_length()


def to_unit(scores: Mapping[int, float], logits: bool = False) -> dict[int, float]:
    """Scores on 0..1 as they are, unless `logits` says they are; otherwise read as
    logits and passed through a sigmoid."""
    if not logits and all(0.0 <= s <= 1.0 for s in scores.values()):
        return dict(scores)
    return {i: 1 / (1 + math.exp(-max(min(s, 60.0), -60.0))) for i, s in scores.items()}


async def map_pairs(
    count: int,
    one: Callable[[int], Awaitable[PairOutcome]],
    emit: Emit,
    calls: CallTasks,
) -> None:
    """Run `one(i)` for every pair concurrently, emitting each outcome as it lands.

    One task per pair, which makes its backend call itself (registered in `calls`, the
    pool's). When this is cancelled (the request stopped waiting) or a pair raises, the
    tasks still running are let go (`CallTasks.let_go`): cancelled before their call is
    sent, abandoned after. Not a task group: it would cancel calls on the wire outright,
    and so would a timeout inside `one` (no leash, no timeout counted against the
    instance): `one` must not cancel its own task.
    """
    if not count:
        return
    loop = asyncio.get_running_loop()
    finished: asyncio.Future[None] = loop.create_future()
    left = count

    async def run(i: int) -> None:
        nonlocal left
        me = asyncio.current_task()
        assert me is not None
        calls.own(me)  # here, not after create_task: an eager task factory runs it first
        try:
            emit(await one(i))
        except Exception as exc:  # a bug: the scorer crashes, as a task group would
            if finished.done():  # the request is gone (or another pair crashed first)
                log.error("pair_crashed_unheard", error=type(exc).__name__)
            else:
                finished.set_exception(exc)
        finally:
            calls.done(me)
            left -= 1
            if not left and not finished.done():
                finished.set_result(None)

    tasks = [loop.create_task(run(i)) for i in range(count)]
    try:
        await finished
    finally:
        for task in tasks:
            calls.let_go(task)


def failed_all(indexes: Sequence[int], exc: BackendCallError, emit: Emit) -> None:
    for i in indexes:
        emit(PairOutcome.failed(i, exc.failure, exc.detail))
