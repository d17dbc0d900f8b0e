"""The `model` scenario: the same passages scored directly and through rerank-server,
alternating, with the physical limit (eager PyTorch) beside them."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
from rerank_client import AsyncRerankClient

from . import physical
from .common import SLOTS, passages, pct
from .direct import CALL_TIMEOUT_S, direct_call, rendered_prompts, through
from .processes import rerank_server


@dataclass(frozen=True)
class Eager:
    """Where to measure the physical limit: the backend's GGUF and a Python with torch
    (`physical.py`); `skipped` says why it is not measured when either is missing."""

    model: Path | None = None
    python: Path | None = None
    skipped: str = ""


async def model(
    url: str,
    rounds: int,
    count: int,
    kind: str = "chat",
    slots: int = SLOTS,
    clients: Sequence[int] = (),
    seconds: float = 5.0,
    eager: Eager = Eager(),
) -> dict[str, Any]:
    """The same passages scored directly and through rerank-server, alternating; then,
    for each count in `clients`, that many clients sending requests back to back for
    `seconds`, directly and through, in pairs/s (`_load`); then the same pairs in eager
    PyTorch (`physical.py`) when `eager` can."""
    docs = passages(count, seed=11)
    times: dict[str, list[float]] = {"direct": [], "through": []}
    lost = {"direct": 0, "through": 0}  # pairs not scored, over the measured rounds
    batch = 32
    direct = direct_call(kind, slots, batch)
    args = [
        "--backend",
        kind,
        "--backend-url",
        url,
        "--concurrency",
        str(slots),
        "--max-batch",
        str(batch),
        "--timeout-ms",
        str(CALL_TIMEOUT_S * 1000),
        "--backend-timeout-ms",
        str(CALL_TIMEOUT_S * 1000),
        "--blend-strategy",
        "position_aware",
        "--max-candidates",
        str(max(count, 1)),
    ]
    if kind in ("chat", "completion"):
        args.append("--no-assistant-prefill")
    with rerank_server(args) as (port, _):
        async with (
            AsyncRerankClient(f"127.0.0.1:{port}") as client,
            httpx.AsyncClient(timeout=CALL_TIMEOUT_S) as http,
        ):
            for r in range(rounds + 1):
                order = ("direct", "through") if r % 2 == 0 else ("through", "direct")
                for path in order:
                    query = f"round {r} {path} which passage is about river energy"
                    started = time.perf_counter()
                    if path == "direct":
                        missed = await direct(http, url, query, docs)
                    else:
                        missed = await through(client, query, docs)
                    if r:  # round 0 warms up
                        times[path].append(time.perf_counter() - started)
                        lost[path] += missed
            load = {
                str(n): await _load(n, seconds, port, url, kind, slots, batch, docs)
                for n in clients
            }
            limit = await _eager(http, url, docs, rounds, eager)
    direct_s, through_s = (statistics.median(times["direct"]), statistics.median(times["through"]))
    if "pairs_per_s" in limit:
        limit["through_over_eager"] = round(len(docs) / through_s / limit["pairs_per_s"], 3)
    return {
        "backend": kind,
        "passages": len(docs),
        "slots": slots,
        "rounds": rounds,
        "eager": limit,
        "direct_ms": round(direct_s * 1000),
        "through_ms": round(through_s * 1000),
        "through_over_direct": round(through_s / direct_s, 3),
        **{
            f"{path}_p{q}_ms": round(pct(times[path], q / 100) * 1000)
            for path in ("direct", "through")
            for q in (50, 95)
        },
        "direct_pairs_per_s": round(len(docs) / direct_s, 1),
        "through_pairs_per_s": round(len(docs) / through_s, 1),
        "direct_failed_pairs": lost["direct"],
        "through_unscored_pairs": lost["through"],
        "load": load,
    }


async def _eager(
    http: httpx.AsyncClient, url: str, docs: Sequence[str], rounds: int, eager: Eager
) -> dict[str, Any]:
    """The physical limit's report, or why there is none (the bench goes on without)."""
    if eager.model is None or eager.python is None:
        return {"skipped": eager.skipped}
    try:
        prompts = await rendered_prompts(http, url, "which passage is about river energy", docs)
        tokens = await physical.prompt_tokens(http, url, prompts)
        return await physical.eager_limit(eager.python, eager.model, tokens, rounds)
    except (httpx.HTTPError, KeyError, ValueError, RuntimeError) as exc:
        return {"skipped": f"failed: {exc}"}


async def _load(
    clients: int,
    seconds: float,
    port: int,
    url: str,
    kind: str,
    slots: int,
    batch: int,
    docs: Sequence[str],
) -> dict[str, Any]:
    """Pairs/s with `clients` sending requests back to back: directly (every client's
    pairs at once, one limit of `slots` for them all, as rerank-server's `--concurrency`
    is) and through rerank-server (a connection per client). Each path runs for `seconds`
    in two halves, in the order direct, through, through, direct: a backend that slows
    down over a run then weighs on both alike instead of on whichever came second. A
    request still running when the time is up counts when it ends, over the time it
    took. Only pairs scored count; those that were not (a failed call, a degraded
    answer) are reported beside the rates, and a failed request does not stop the run."""

    async def rate(
        one: Callable[[int, int], Awaitable[int]], span: float
    ) -> tuple[int, int, float]:
        done = missed = 0
        started = time.perf_counter()
        stop_at = started + span

        async def loop(n: int) -> None:
            nonlocal done, missed
            i = 0
            while time.perf_counter() < stop_at:
                lost = await one(n, i)
                done += len(docs) - lost
                missed += lost
                i += 1

        await asyncio.gather(*(loop(n) for n in range(clients)))
        return done, missed, time.perf_counter() - started

    direct = direct_call(kind, slots, batch, shared=asyncio.Semaphore(slots))
    async with contextlib.AsyncExitStack() as stack:
        http = await stack.enter_async_context(httpx.AsyncClient(timeout=CALL_TIMEOUT_S))
        connections = [
            await stack.enter_async_context(
                AsyncRerankClient(f"127.0.0.1:{port}", own_connection=True)
            )
            for _ in range(clients)
        ]
        calls: dict[str, Callable[[int, int, int], Awaitable[int]]] = {
            "direct": lambda h, n, i: direct(http, url, f"load {h} {n} {i} direct", docs),
            "through": lambda h, n, i: through(connections[n], f"load {h} {n} {i}", docs),
        }
        scored = dict.fromkeys(calls, 0)
        lost = dict.fromkeys(calls, 0)
        spent = dict.fromkeys(calls, 0.0)
        spans = []  # each half's rate in the order run: shows a drifting backend
        for half, order in enumerate((("direct", "through"), ("through", "direct"))):
            for path in order:
                done, missed, took = await rate(partial(calls[path], half), seconds / 2)
                spans.append(f"{path} {done / took:.1f}")
                scored[path] += done
                lost[path] += missed
                spent[path] += took
    direct_rate, through_rate = (scored[p] / spent[p] for p in ("direct", "through"))
    return {
        "direct_pairs_per_s": round(direct_rate, 1),
        "through_pairs_per_s": round(through_rate, 1),
        "through_over_direct": round(through_rate / direct_rate, 3) if direct_rate else None,
        "direct_failed_pairs": lost["direct"],
        "through_unscored_pairs": lost["through"],
        "halves": spans,
    }
