"""Choosing a request's chunks off the event loop when its documents are large.

The thread, the wait and the fallback: docs/architecture.md, "The pipeline", step 4.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import NamedTuple, TypeVar

import structlog

from ..domain import Candidate
from .chunking import CHUNK_ON_LOOP_CHARS, chars_to_chunk, document_texts, head_texts
from .request import Request

T = TypeVar("T")
log = structlog.get_logger(__name__)

_CHUNKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rerank-chunk")
# A request waits for the chunking thread at most this share of its time (timeout or
# deadline, whichever is shorter), counted from its arrival; the rest is for scoring.
CHUNK_WAIT_SHARE = 0.5
MIN_CHUNK_WAIT_S = 0.05  # for an idle thread to take the job up


class Chunked(NamedTuple):
    """The texts a request scores, and how they were chosen."""

    documents: list[str]  # what is scored, one per candidate
    chunked: int  # documents cut to their best chunk
    fell_back: bool  # the thread stayed busy: the documents' heads instead


async def choose_chunks(
    request: Request,
    candidates: Sequence[Candidate],
    deadline_remaining_s: float | None,
    started: float,
) -> Chunked:
    """The text scored for each candidate: its best chunk for the query, on the loop when
    the documents are small, else in the chunking thread (or, past the wait, its head)."""
    max_chars = request.max_chunk_chars
    if chars_to_chunk(candidates, max_chars) <= CHUNK_ON_LOOP_CHARS:
        return Chunked(*document_texts(request.query, candidates, max_chars), False)
    found = await _off_loop(
        partial(document_texts, request.query, candidates, max_chars),
        _wait_s(request, deadline_remaining_s, started),
    )
    if found is not None:
        return Chunked(*found, False)
    log.info(
        "chunking_busy",
        fallback="document heads",
        waited_ms=round((time.perf_counter() - started) * 1000, 1),
    )
    return Chunked(*head_texts(candidates, max_chars), True)


def _wait_s(request: Request, deadline_remaining_s: float | None, started: float) -> float:
    limit = (
        request.timeout_s
        if deadline_remaining_s is None
        else min(request.timeout_s, deadline_remaining_s)
    )
    return max(CHUNK_WAIT_SHARE * limit - (time.perf_counter() - started), MIN_CHUNK_WAIT_S)


async def _off_loop(job: Callable[[], T], wait_s: float) -> T | None:
    """`job` in the chunking thread; None when the thread has not taken it up within
    `wait_s` (it is then withdrawn). A job begun is waited for to its end, and so is one
    of a request cancelled meanwhile: the request's place and bytes stay counted while
    its texts are still being read, so cancelled requests cannot pile work up behind
    the budget."""
    begun = threading.Event()

    def run() -> T:
        begun.set()
        return job()

    submitted = _CHUNKER.submit(run)
    future = asyncio.wrap_future(submitted)
    try:
        await asyncio.wait({future}, timeout=wait_s)
        if not future.done() and not begun.is_set() and submitted.cancel():
            return None
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        if not submitted.cancel():  # withdrawn if not begun; else waited for
            await asyncio.wait({future})
        raise
