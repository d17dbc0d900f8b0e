"""`rerank-server bench`: what rerank-server costs and what it delivers, side by side.

    rerank-server bench [--scenarios overhead,telemetry,model,throughput,streaming,backends]
                        [--requests 100] [--rounds 5] [--out bench-results]

Every comparison runs in one invocation, alternating the things compared, and reports
ratios beside times (these machines are noisy). Scenarios:

- overhead: an instant fake backend (`fake_backend.py`, its own process); per backend
  kind and 10/40/100 candidates, latency p50/p99 per request, the same backend calls
  replayed straight to the fake (`replay.py`: the backend's own time), the latency
  rerank-server adds (p50 through - p50 direct), the same request to a bare gRPC server
  (`bare_grpc.py`: the hop alone), and rerank-server's CPU time per scored pair (read
  from /proc for the server process alone).
- telemetry: what metrics and traces add per 40-candidate request (`telemetry.py`), for
  `chat` and for `rerank` (a batching backend): five servers in this process, off /
  metrics / metrics+traces / metrics+traces+steps (a span per CPU-only step) /
  metrics+traces+calls (a span per backend call), round-robin against the fake backend.
- model: the same passages scored against llama-server directly (concurrent chat calls
  at the slot count, the best direct strategy) and through rerank-server (chat backend,
  same concurrency); through/direct is our efficiency. With `--clients 1,4,16`, also
  pairs/s with that many clients at once for `--seconds` each, directly (one limit of
  the slot count for all of them) and through. Then the physical limit beside it: the
  same weights and tokens in eager PyTorch (`eager.py`: the stand-in, or `--eager-model`
  for a `--backend-url`), when a Python with torch is at hand (this one, or the
  converter's environment from `rerank-server prepare`), as through / eager.
- throughput: 1, 4, 16 and 64 concurrent clients (each on its own connection) against
  the fake backend, with 1 and N `--workers` (`--workers 1,2`): requests/s,
  pairs/s, p50/p99, errors.
- streaming: time to the first `RerankStream` result against the whole `Rerank` answer,
  for every blend (the default included), against a backend with a fixed time per call
  and against llama-server, at 10/40/100 candidates.
- backends: `chat` (per pair) against `completion` (batched) on llama-server.
- settings (only when named): a fresh llama-server per `-np`/`-ub` cell of `--grid`,
  `chat` and `completion` through rerank-server on each.
- completion-options (only when named): llama-server's `/completion` with an array of
  prompts, called directly, per `n_probs` (20, what `completion` asks for, 5, 1) and with
  `cache_prompt` off: the time, and how often "yes" or "no" is among the top `n_probs`.

The llama-server scenarios use the cached build and stand-in model (`make assets`), or
any running backend: `--backend-url URL --slots N [--backend chat|embedding|rerank]`
(a GPU llama-server, vLLM, TEI); `model` then compares the best direct client for that
kind (every pair or batch at once, N in flight) with rerank-server at the same
concurrency, in latency and pairs/s.
Writes `bench.json`, `bench.md`, `bench-latency.png` and `bench-throughput.png`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
from rerank_client import AsyncRerankClient, RerankError, Result, Summary

from ..managed import assets
from ..scoring.backends import prompt
from ..settings import DEFAULT_INSTRUCTION, load
from . import physical, replay
from .processes import bare_grpc, cpu_seconds, fake_backend, llama_server, rerank_server
from .telemetry import KINDS as TELEMETRY_KINDS
from .telemetry import telemetry_cost, telemetry_markdown

SCENARIOS = ("overhead", "telemetry", "model", "throughput", "streaming", "backends")
# Run only when named: a llama-server per grid cell takes minutes on a CPU.
OPT_IN = ("settings", "completion-options")
GRID = ((1, 512), (2, 512), (4, 512), (4, 2048))
KINDS = ("chat", "completion", "rerank", "embedding", "ollama", "llm")
SIZES = (10, 40, 100)
CLIENTS = (1, 4, 16, 64)
SLOTS = 4
# Where issue 17 set its targets (CPU per pair, added latency, telemetry's share of them).
TELEMETRY_CANDIDATES = 40
WORDS = [
    "river",
    "bank",
    "model",
    "light",
    "engine",
    "garden",
    "market",
    "signal",
    "paper",
    "stone",
    "winter",
    "forest",
    "language",
    "history",
    "system",
    "answer",
    "window",
    "energy",
    "doctor",
    "village",
    "music",
    "animal",
    "station",
    "theory",
    "bridge",
    "number",
    "planet",
    "letter",
    "kitchen",
    "season",
]


def passages(n: int, seed: int = 7, chars: int = 600) -> list[str]:
    """Deterministic English-like passages of about `chars` characters."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words: list[str] = []
        while sum(len(w) + 1 for w in words) < chars:
            words.append(rng.choice(WORDS))
        out.append(" ".join(words).capitalize() + ".")
    return out


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _ms(seconds: Sequence[float]) -> dict[str, float]:
    return {
        "p50_ms": round(pct(seconds, 0.5) * 1000, 2),
        "p99_ms": round(pct(seconds, 0.99) * 1000, 2),
    }


async def _timed(call: Callable[[], Awaitable[Any]]) -> float:
    started = time.perf_counter()
    await call()
    return time.perf_counter() - started


OVERHEAD_CONCURRENCY = 8


def backend_args(kind: str, url: str) -> list[str]:
    args = [
        "--backend",
        kind,
        "--backend-url",
        url,
        "--concurrency",
        str(OVERHEAD_CONCURRENCY),
        "--max-candidates",
        "100",
        "--max-batch",
        "100",
    ]
    return args + (["--model", "instant"] if kind in ("ollama", "llm") else [])


async def overhead(requests: int) -> dict[str, Any]:
    """Per kind and size: `requests` through rerank-server, each followed (or, every other
    one, preceded) by the same backend calls replayed directly (`replay.py`) and by the
    same request to a bare gRPC server (`bare_grpc.py`), so all three see the same moment
    of a noisy machine. added = p50 through - p50 direct; the bare server's p50 is the
    part of it that is the gRPC hop with this client."""
    results: dict[str, Any] = {}
    with fake_backend() as url, bare_grpc() as (bare_port, bare_pid):
        async with httpx.AsyncClient() as http, AsyncRerankClient(f"127.0.0.1:{bare_port}") as bare:
            for kind in KINDS:
                with rerank_server(backend_args(kind, url)) as (port, pid):
                    async with AsyncRerankClient(f"127.0.0.1:{port}") as client:
                        for size in SIZES:
                            results.setdefault(kind, {})[str(size)] = await _overhead_cell(
                                client, (bare, bare_pid), http, url, pid, passages(size), requests
                            )
    return results


async def _overhead_cell(
    client: AsyncRerankClient,
    bare_server: tuple[AsyncRerankClient, int],
    http: httpx.AsyncClient,
    url: str,
    pid: int,
    docs: list[str],
    requests: int,
) -> dict[str, Any]:
    """One backend kind and size: latencies and CPU per pair, the server idle between
    requests (as one client in turn sees it), then CPU per pair with the same requests
    sent back to back (the server busy, as it is when it runs at capacity)."""
    bare, bare_pid = bare_server
    for i in range(3):  # warm-up
        await client.rerank(f"warm {i}", docs)
        await bare.rerank(f"warm {i}", docs)
    await replay.start_recording(http, url)
    await client.rerank("q recorded", docs)
    calls = await replay.recorded_calls(http, url)
    through: list[float] = []
    direct: list[float] = []
    floor: list[float] = []
    async with replay.Replay(url, calls, OVERHEAD_CONCURRENCY) as backend:
        # The server is idle while the calls are replayed and the bare server answers:
        # its CPU over the loop is its own work for the requests (and what each left to
        # do after answering).
        cpu0, bare_cpu0 = cpu_seconds(pid), cpu_seconds(bare_pid)
        for i in range(requests):
            if i % 2:
                direct.append(await _timed(backend.run))
                floor.append(await _timed(partial(bare.rerank, f"q {i}", docs)))
            through.append(await _timed(partial(client.rerank, f"q {i}", docs)))
            if not i % 2:
                floor.append(await _timed(partial(bare.rerank, f"q {i}", docs)))
                direct.append(await _timed(backend.run))
        cpu, bare_cpu = cpu_seconds(pid) - cpu0, cpu_seconds(bare_pid) - bare_cpu0

    # The same requests again, back to back: on this VM a process that went idle between
    # requests pays for it in the next one (cold caches; the bare server too, by a
    # quarter or more), so the alternating loop above measures a server used lightly,
    # and this one what each pair costs a server kept busy, which bounds its capacity.
    # Two loops in turn keep it busy: one request is worked on while the other's answer
    # travels.
    async def loop(n: int) -> None:
        for i in range(requests // 2):
            await client.rerank(f"busy {n} {i}", docs)

    busy0 = cpu_seconds(pid)
    await asyncio.gather(loop(0), loop(1))
    busy = cpu_seconds(pid) - busy0
    busy_pairs = requests // 2 * 2 * len(docs)
    times = _ms(through)
    direct_p50 = round(pct(direct, 0.5) * 1000, 2)
    per_pair = 1e6 / (requests * len(docs))
    return {
        **times,
        "direct_p50_ms": direct_p50,
        "added_p50_ms": round(times["p50_ms"] - direct_p50, 2),
        "bare_grpc_p50_ms": round(pct(floor, 0.5) * 1000, 2),
        "backend_calls": len(calls),
        "cpu_us_per_pair": round(cpu * per_pair, 1),
        "busy_cpu_us_per_pair": round(busy * 1e6 / busy_pairs, 1),
        "bare_grpc_cpu_us_per_pair": round(bare_cpu * per_pair, 1),
        "latencies_ms": [round(x * 1000, 3) for x in through],
    }


async def _answered(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> bool:
    """One direct call: whether the backend answered it with a 2xx."""
    try:
        return (await http.post(url, json=body)).is_success
    except httpx.HTTPError:
        return False


async def _direct_chat(
    http: httpx.AsyncClient,
    url: str,
    query: str,
    docs: Sequence[str],
    slots: int = SLOTS,
    shared: asyncio.Semaphore | None = None,
) -> int:
    """The best direct strategy: every pair at once, `slots` in flight (or `shared`'s,
    a limit several direct clients hold together, as rerank-server's requests do).
    Returns how many pairs the backend did not answer."""
    limit = shared or asyncio.Semaphore(slots)

    async def one(doc: str) -> bool:
        body = {
            "messages": [
                {"role": "system", "content": prompt.SYSTEM_PROMPT},
                {"role": "user", "content": prompt.user_message(DEFAULT_INSTRUCTION, query, doc)},
            ],
            "max_tokens": 1,
            "temperature": 0.0,
            "logprobs": True,
            "top_logprobs": 20,
        }
        async with limit:
            return await _answered(http, url + "/v1/chat/completions", body)

    return sum(not ok for ok in await asyncio.gather(*(one(d) for d in docs)))


_DOCUMENT = "@@document@@"


async def rendered_prompts(
    http: httpx.AsyncClient, url: str, query: str, docs: Sequence[str]
) -> list[str]:
    """Each pair's prompt, rendered once by llama-server's own template
    (`/apply-template`)."""
    messages = [
        {"role": "system", "content": prompt.SYSTEM_PROMPT},
        {"role": "user", "content": prompt.user_message(DEFAULT_INSTRUCTION, query, _DOCUMENT)},
    ]
    rendered = (await http.post(url + "/apply-template", json={"messages": messages})).json()[
        "prompt"
    ]
    return [rendered.replace(_DOCUMENT, doc) for doc in docs]


async def _direct_completion(
    http: httpx.AsyncClient,
    url: str,
    query: str,
    docs: Sequence[str],
    slots: int,
    batch: int,
    shared: asyncio.Semaphore | None = None,
) -> int:
    """`/completion` with arrays of prompts, `batch` to a call, `slots` calls in flight,
    rendered as the `completion` backend renders them."""
    prompts = await rendered_prompts(http, url, query, docs)
    chunks = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
    return await _direct_batches(
        http,
        url,
        "/completion",
        [{"prompt": c, "n_probs": 20, "n_predict": 1, "temperature": 0.0} for c in chunks],
        [len(c) for c in chunks],
        slots,
        shared,
    )


async def _direct_batches(
    http: httpx.AsyncClient,
    url: str,
    path: str,
    bodies: Sequence[dict[str, Any]],
    pairs: Sequence[int],
    slots: int,
    shared: asyncio.Semaphore | None = None,
) -> int:
    """Batched backends, directly: every batch at once, `slots` in flight. `pairs`: how
    many pairs each body's failure loses. Returns how many the backend did not answer."""
    limit = shared or asyncio.Semaphore(slots)

    async def one(body: dict[str, Any]) -> bool:
        async with limit:
            return await _answered(http, url + path, body)

    answered = await asyncio.gather(*(one(b) for b in bodies))
    return sum(n for ok, n in zip(answered, pairs, strict=True) if not ok)


def direct_call(
    kind: str, slots: int, batch: int, shared: asyncio.Semaphore | None = None
) -> Callable[[httpx.AsyncClient, str, str, Sequence[str]], Awaitable[int]]:
    """The best direct client for a backend kind: what rerank-server is compared with.
    `shared`: one limit of `slots` for every request made through it. The call returns
    how many of its pairs the backend did not answer (a failed batch loses all of its
    pairs; a failed query embedding, every pair)."""
    if kind == "chat":
        return partial(_direct_chat, slots=slots, shared=shared)
    if kind == "completion":
        return partial(_direct_completion, slots=slots, batch=batch, shared=shared)

    async def batched(http: httpx.AsyncClient, url: str, query: str, docs: Sequence[str]) -> int:
        chunks = [list(docs[i : i + batch]) for i in range(0, len(docs), batch)]
        if kind == "embedding":  # the query once, then the documents in batches
            failed = await _direct_batches(
                http,
                url,
                "/v1/embeddings",
                [{"input": [query]}, *({"input": c} for c in chunks)],
                [len(docs), *(len(c) for c in chunks)],
                slots,
                shared,
            )
            return min(failed, len(docs))
        return await _direct_batches(
            http,
            url,
            "/v1/rerank",
            [{"query": query, "documents": c} for c in chunks],
            [len(c) for c in chunks],
            slots,
            shared,
        )

    return batched


async def _through(client: AsyncRerankClient, query: str, docs: Sequence[str]) -> int:
    """One request through rerank-server: how many of its pairs were not scored. A
    degraded answer comes back fast and in retrieval order, so timing it as if scored
    would flatter rerank-server; the scenarios count such pairs and say so."""
    try:
        answer = await client.rerank(query, docs, timeout=120)
    except RerankError:
        return len(docs)
    return len(docs) - answer.summary.scored


DIRECT_KINDS = ("chat", "completion", "embedding", "rerank")


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
        "120000",
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
            httpx.AsyncClient(timeout=120) as http,
        ):
            for r in range(rounds + 1):
                order = ("direct", "through") if r % 2 == 0 else ("through", "direct")
                for path in order:
                    query = f"round {r} {path} which passage is about river energy"
                    started = time.perf_counter()
                    if path == "direct":
                        missed = await direct(http, url, query, docs)
                    else:
                        missed = await _through(client, query, docs)
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
    down over a run (llama-server's `/v1/rerank` did on a GPU, by more than half in 10 s) then
    weighs on both alike instead of on whichever came second. A request still running
    when the time is up counts when it ends, over the time it took. Only pairs scored
    count; those that were not (a failed call, a degraded answer) are reported beside
    the rates, and a failed request does not stop the run."""

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
        http = await stack.enter_async_context(httpx.AsyncClient(timeout=120))
        connections = [
            await stack.enter_async_context(
                AsyncRerankClient(f"127.0.0.1:{port}", own_connection=True)
            )
            for _ in range(clients)
        ]
        calls: dict[str, Callable[[int, int, int], Awaitable[int]]] = {
            "direct": lambda h, n, i: direct(http, url, f"load {h} {n} {i} direct", docs),
            "through": lambda h, n, i: _through(connections[n], f"load {h} {n} {i}", docs),
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


async def throughput(seconds: float, workers: Sequence[int] = (1,)) -> dict[str, Any]:
    """Requests/s at each client count, for each `--workers` setting (the same total
    `--concurrency`). Every client has its own connection, as separate client processes
    would: workers share connections, not calls."""
    docs = passages(20, seed=3)
    results: dict[str, Any] = {}
    with fake_backend() as url:
        for count in workers:
            with rerank_server([*backend_args("chat", url), "--workers", str(count)]) as (port, _):
                results[str(count)] = {
                    str(clients): await _throughput_at(port, clients, docs, seconds)
                    for clients in CLIENTS
                }
    return results


async def _throughput_at(
    port: int,
    clients: int,
    docs: Sequence[str],
    seconds: float,
) -> dict[str, Any]:
    latencies: list[float] = []
    errors: list[str] = []
    async with contextlib.AsyncExitStack() as stack:
        connections = [
            await stack.enter_async_context(
                AsyncRerankClient(f"127.0.0.1:{port}", own_connection=True)
            )
            for _ in range(clients)
        ]
        stop_at = time.perf_counter() + seconds
        started = time.perf_counter()
        await asyncio.gather(
            *(
                _client_loop(n, c, docs, stop_at, latencies, errors)
                for n, c in enumerate(connections)
            )
        )
        elapsed = time.perf_counter() - started
    return {
        "requests_per_s": round(len(latencies) / elapsed, 1),
        "pairs_per_s": round(len(latencies) * len(docs) / elapsed),
        "errors": len(errors),
        **_ms(latencies),
    }


async def _client_loop(
    n: int,
    client: AsyncRerankClient,
    docs: Sequence[str],
    stop_at: float,
    latencies: list[float],
    errors: list[str],
) -> None:
    """One benchmark client: requests back to back until `stop_at`."""
    i = 0
    while time.perf_counter() < stop_at:
        started = time.perf_counter()
        try:
            await client.rerank(f"client {n} query {i}", docs)
            latencies.append(time.perf_counter() - started)
        except RerankError as exc:
            errors.append(exc.code)
        i += 1


BLENDS = ("default", "position_aware", "linear", "rerank_only", "adaptive")


async def stream_timing(
    port: int,
    docs: list[str],
    blend: str,
    rounds: int,
) -> dict[str, Any]:
    """Median time to the first `RerankStream` result and to the whole `Rerank` answer,
    alternating the two; `blend` "default" leaves the choice to the server (`profile`)."""
    first: list[float] = []
    whole: list[float] = []
    strategy = None if blend == "default" else blend
    summary: Summary | None = None
    async with AsyncRerankClient(f"127.0.0.1:{port}") as client:
        for r in range(rounds + 1):  # round 0 warms up
            for mode in ("stream", "unary") if r % 2 == 0 else ("unary", "stream"):
                # A query of its own per call: no score cache, no prompt cache.
                query = f"round {r} {mode} {blend} garden music"
                started = time.perf_counter()
                if mode == "unary":
                    answer = await client.rerank(query, docs, blend_strategy=strategy)
                    summary = answer.summary
                    if r:
                        whole.append(time.perf_counter() - started)
                    continue
                got_first: float | None = None
                async for item in client.stream(query, docs, blend_strategy=strategy):
                    if isinstance(item, Result) and got_first is None:
                        got_first = time.perf_counter() - started
                if r and got_first is not None:
                    first.append(got_first)
    assert summary is not None
    blended = " ".join(filter(None, (summary.blend_strategy, summary.blend_profile)))
    if summary.degraded_code:
        blended += f" ({summary.degraded_code})"
    return {
        "blended_by": blended,
        "first_result_ms": round(statistics.median(first) * 1000),
        "whole_answer_ms": round(statistics.median(whole) * 1000),
        "first_over_whole": round(statistics.median(first) / statistics.median(whole), 3),
    }


async def streaming(
    llama: str,
    rounds: int,
    latency_ms: float,
    sizes: Sequence[int],
    kind: str = "chat",
    slots: int = SLOTS,
    label: str = "llama-server",
) -> dict[str, Any]:
    """Every blend against a backend with a fixed time per call and against llama-server
    (stand-in model, whose shipped profile gives the reranker no weight). The fixed
    latency: `latency_ms` per call, 2 at a time, 12 candidates (the setting of the issue
    that asked for streaming under the default blend), then `sizes` at a sixth of it, 4
    at a time."""
    out: dict[str, Any] = {}
    for delay_ms, concurrency, counts in ((latency_ms, 2, (12,)), (latency_ms / 6, SLOTS, sizes)):
        with (
            fake_backend(delay_ms) as url,
            rerank_server(
                ["--backend-url", url, "--concurrency", str(concurrency), "--timeout-ms", "120000"]
            ) as (port, _),
        ):
            for size in counts:
                docs = passages(size, seed=5)
                out[f"fixed {delay_ms:g} ms x{concurrency}, {size}"] = {
                    blend: await stream_timing(port, docs, blend, rounds) for blend in BLENDS
                }
    args = [
        "--backend",
        kind,
        "--backend-url",
        llama,
        "--concurrency",
        str(slots),
        "--timeout-ms",
        "120000",
    ]
    with rerank_server(args + (["--no-assistant-prefill"] if kind == "chat" else [])) as (port, _):
        for size in sizes:
            docs = passages(size, seed=5)
            out[f"{label} x{slots}, {size}"] = {
                blend: await stream_timing(port, docs, blend, rounds) for blend in BLENDS
            }
    return out


async def settings_grid(
    grid: Sequence[tuple[int, int]],
    rounds: int,
    count: int,
) -> dict[str, Any]:
    """llama-server's settings against our two ways of calling it: for each (-np, -ub)
    a fresh llama-server (stand-in model), `count` passages through rerank-server as
    concurrent `chat` calls and as one `completion` call with an array of prompts; the
    median of `rounds` after a warm-up, each round with a query of its own (no prompt
    cache across rounds)."""
    docs = passages(count, seed=13)
    out: dict[str, Any] = {}
    for slots, ubatch in grid:
        row: dict[str, Any] = {}
        with llama_server(slots, ["-b", str(max(2048, ubatch)), "-ub", str(ubatch)]) as url:
            for kind in ("chat", "completion"):
                # position_aware: the stand-in's profile would send no pair at all.
                args = [
                    "--backend",
                    kind,
                    "--backend-url",
                    url,
                    "--concurrency",
                    str(slots),
                    "--no-assistant-prefill",
                    "--timeout-ms",
                    "600000",
                    "--blend-strategy",
                    "position_aware",
                    "--max-batch",
                    str(count),
                    "--max-candidates",
                    str(count),
                ]
                times: list[float] = []
                with rerank_server(args) as (port, _):
                    async with AsyncRerankClient(f"127.0.0.1:{port}") as client:
                        for r in range(rounds + 1):
                            query = f"round {r} {kind} np {slots} ub {ubatch} river energy"
                            t = await _timed(partial(client.rerank, query, docs))
                            if r:
                                times.append(t)
                median = statistics.median(times)
                row[kind] = {
                    "ms": round(median * 1000),
                    "pairs_per_s": round(len(docs) / median, 2),
                }
        out[f"-np {slots} -ub {ubatch}"] = row
    return out


# (n_probs, cache_prompt): what the `completion` backend sends first.
COMPLETION_OPTIONS = ((20, True), (5, True), (1, True), (20, False))


async def completion_options(llama: str, rounds: int, count: int) -> dict[str, Any]:
    """`count` prompts in one `/completion` call straight to llama-server, per option in
    `COMPLETION_OPTIONS`: the median time of `rounds` (after a warm-up, options
    alternating, each call with a query of its own so no prompt is cached from an earlier
    call) and the share of prompts with "yes" or "no" among the top `n_probs`."""
    docs = passages(count, seed=17)
    times: dict[tuple[int, bool], list[float]] = {o: [] for o in COMPLETION_OPTIONS}
    found: dict[tuple[int, bool], list[float]] = {o: [] for o in COMPLETION_OPTIONS}
    async with httpx.AsyncClient(base_url=llama, timeout=600) as http:
        answer_ids = set()
        for word in ("yes", "Yes", "no", "No"):
            tokens = (await http.post("/tokenize", json={"content": word})).json()["tokens"]
            if len(tokens) == 1:
                answer_ids.add(tokens[0])
        for r in range(rounds + 1):
            for option in COMPLETION_OPTIONS if r % 2 == 0 else COMPLETION_OPTIONS[::-1]:
                n_probs, cache = option
                query = f"round {r} n_probs {n_probs} cache {cache} harbour light"
                message = prompt.user_message(DEFAULT_INSTRUCTION, query, "\x00")
                rendered = (
                    await http.post(
                        "/apply-template",
                        json={
                            "messages": [
                                {"role": "system", "content": prompt.SYSTEM_PROMPT},
                                {"role": "user", "content": message},
                            ]
                        },
                    )
                ).json()["prompt"]
                prefix, _, suffix = rendered.partition("\x00")
                body = {
                    "prompt": [prefix + d + suffix for d in docs],
                    "n_probs": n_probs,
                    "n_predict": 1,
                    "temperature": 0.0,
                    "cache_prompt": cache,
                }
                started = time.perf_counter()
                response = await http.post("/completion", json=body)
                elapsed = time.perf_counter() - started
                results = response.json()
                if r:
                    times[option].append(elapsed)
                    found[option].append(
                        statistics.fmean(
                            any(
                                e.get("id") in answer_ids
                                for e in res["completion_probabilities"][0]["top_logprobs"]
                            )
                            for res in results
                        )
                    )
    return {
        f"n_probs {n}, cache_prompt {'on' if c else 'off'}": {
            "ms": round(statistics.median(times[(n, c)]) * 1000),
            "pairs_per_s": round(count / statistics.median(times[(n, c)]), 2),
            "yes_or_no_in_top": round(statistics.fmean(found[(n, c)]), 3),
        }
        for n, c in COMPLETION_OPTIONS
    }


async def backends(llama: str, rounds: int, count: int, slots: int) -> dict[str, Any]:
    docs = passages(count, seed=9)
    times: dict[str, list[float]] = {"chat": [], "completion": []}
    common = [
        "--backend-url",
        llama,
        "--concurrency",
        str(slots),
        "--no-assistant-prefill",
        "--timeout-ms",
        "120000",
        "--max-batch",
        str(len(docs)),
    ]
    with (
        rerank_server(["--backend", "chat", *common]) as (chat_port, _),
        rerank_server(["--backend", "completion", *common]) as (completion_port, _),
    ):
        ports = {"chat": chat_port, "completion": completion_port}
        for r in range(rounds + 1):
            for kind in ("chat", "completion") if r % 2 == 0 else ("completion", "chat"):
                # A query of its own: the same prompt twice would hit the slots' prompt cache.
                query = f"round {r} {kind} winter station"
                async with AsyncRerankClient(f"127.0.0.1:{ports[kind]}") as client:
                    t = await _timed(partial(client.rerank, query, docs))
                if r:
                    times[kind].append(t)
    chat, completion = statistics.median(times["chat"]), statistics.median(times["completion"])
    return {
        "passages": len(docs),
        "slots": slots,
        "rounds": rounds,
        "chat_ms": round(chat * 1000),
        "completion_ms": round(completion * 1000),
        "completion_over_chat": round(completion / chat, 3),
    }


def markdown(report: dict[str, Any]) -> str:
    lines = [f"Machine: {report['machine']}. Command: `{report['command']}`.", ""]
    if "overhead" in report:
        lines += [
            "#### Overhead (instant fake backend)",
            "",
            "Latency through rerank-server, the same backend calls replayed "
            "directly (the backend's own time), the difference (what rerank-server "
            "adds), and the same request to a bare gRPC server (the hop alone). "
            "Server CPU per pair with the server idle between requests (one client "
            "in turn), with the same requests back to back (busy: what bounds "
            "capacity), and the bare gRPC server's for the same requests (idle "
            "between them: the hop's own share).",
            "",
            "| backend | candidates | p50 ms | p99 ms | direct p50 ms | added p50 ms "
            "| bare gRPC p50 ms | server CPU µs / pair | busy | bare gRPC |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for kind, sizes in report["overhead"].items():
            for size, r in sizes.items():
                lines.append(
                    f"| {kind} | {size} | {r['p50_ms']} | {r['p99_ms']} | "
                    f"{r['direct_p50_ms']} | {r['added_p50_ms']} | "
                    f"{r['bare_grpc_p50_ms']} | {r['cpu_us_per_pair']} | "
                    f"{r['busy_cpu_us_per_pair']} | "
                    f"{r['bare_grpc_cpu_us_per_pair']} |"
                )
        lines.append("")
    if "telemetry" in report:
        for by_kind in report["telemetry"].values():
            lines += telemetry_markdown(by_kind)
    if "model" in report:
        m = report["model"]
        under_test = report.get("backend_under_test", "llama-server, stand-in model")
        lines += [
            f"#### Against the model ({under_test})",
            "",
            f"`{m['backend']}`, {m['passages']} passages, {m['slots']} slots, "
            f"median of {m['rounds']} rounds: direct {m['direct_ms']} ms "
            f"({m['direct_pairs_per_s']} pairs/s), through rerank-server "
            f"{m['through_ms']} ms ({m['through_pairs_per_s']} pairs/s), ratio "
            f"{m['through_over_direct']}; p50/p95 direct {m['direct_p50_ms']}/"
            f"{m['direct_p95_ms']} ms, through {m['through_p50_ms']}/"
            f"{m['through_p95_ms']} ms.",
            "",
        ]
        lines += [_eager_line(m.get("eager", {})), ""]
        rows = [m, *m.get("load", {}).values()]
        lost = [
            sum(r[key] for r in rows) for key in ("direct_failed_pairs", "through_unscored_pairs")
        ]
        if any(lost):
            lines += [
                f"**Not comparable:** the backend did not answer {lost[0]} pairs "
                f"called directly, and {lost[1]} pairs through rerank-server were not "
                f"scored (a degraded answer is fast and in retrieval order), over the "
                f"measured rounds and the load together.",
                "",
            ]
        if m.get("load"):
            lines += [
                "| clients | direct pairs/s | through pairs/s | through / direct "
                "| pairs failed directly | pairs unscored through |",
                "|---|---|---|---|---|---|",
            ]
            lines += [
                f"| {n} | {r['direct_pairs_per_s']} | {r['through_pairs_per_s']} | "
                f"{r['through_over_direct']} | {r['direct_failed_pairs']} | "
                f"{r['through_unscored_pairs']} |"
                for n, r in m["load"].items()
            ]
            lines.append("")
    if "throughput" in report:
        lines += [
            "#### Throughput (instant fake backend, 20 candidates)",
            "",
            "| workers | clients | requests/s | pairs/s | p50 ms | p99 ms | errors |",
            "|---|---|---|---|---|---|---|",
        ]
        for workers, by_clients in report["throughput"].items():
            for clients, r in by_clients.items():
                lines.append(
                    f"| {workers} | {clients} | {r['requests_per_s']} | "
                    f"{r['pairs_per_s']} | {r['p50_ms']} | {r['p99_ms']} | "
                    f"{r['errors']} |"
                )
        lines.append("")
    if "streaming" in report:
        lines += [
            "#### Streaming",
            "",
            "Median time to the first `RerankStream` result and to the whole `Rerank` "
            "answer; `default` is the server's default blend (`profile`).",
            "",
            "| backend, candidates | blend (as answered) | first result ms | "
            "whole answer ms | first / whole |",
            "|---|---|---|---|---|",
        ]
        for setting, blends in report["streaming"].items():
            for blend, r in blends.items():
                lines.append(
                    f"| {setting} | {blend}: {r['blended_by']} | "
                    f"{r['first_result_ms']} | {r['whole_answer_ms']} | "
                    f"{r['first_over_whole']} |"
                )
        lines.append("")
    if "settings" in report:
        lines += [
            "#### llama-server settings (stand-in model, through rerank-server)",
            "",
            "| llama-server | chat ms | chat pairs/s | completion ms | completion pairs/s |",
            "|---|---|---|---|---|",
        ]
        for cell, r in report["settings"].items():
            lines.append(
                f"| `{cell}` | {r['chat']['ms']} | {r['chat']['pairs_per_s']} | "
                f"{r['completion']['ms']} | {r['completion']['pairs_per_s']} |"
            )
        lines.append("")
    if "completion_options" in report:
        lines += [
            "#### `/completion` options (llama-server called directly)",
            "",
            "| options | ms | pairs/s | yes or no in the top n_probs |",
            "|---|---|---|---|",
        ]
        for option, r in report["completion_options"].items():
            lines.append(f"| {option} | {r['ms']} | {r['pairs_per_s']} | {r['yes_or_no_in_top']} |")
        lines.append("")
    if "backends" in report:
        b = report["backends"]
        lines += [
            "#### chat vs completion",
            "",
            f"{b['passages']} passages, {b['slots']} "
            f"slots, median of {b['rounds']}: chat {b['chat_ms']} ms, completion "
            f"{b['completion_ms']} ms (ratio {b['completion_over_chat']}).",
            "",
        ]
    return "\n".join(lines)


def _eager_line(eager: dict[str, Any]) -> str:
    if "pairs_per_s" not in eager:
        return f"Physical limit not measured: {eager.get('skipped') or 'not asked'}."
    return (
        f"Physical limit, the same weights and tokens in eager PyTorch ({eager['device']}, "
        f"{eager['dtype']}, batches of {eager['batch']}, {eager['tokens']} tokens): "
        f"{eager['ms']} ms ({eager['pairs_per_s']} pairs/s); through rerank-server is "
        f"{eager['through_over_eager']} of it."
    )


def plots(report: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    if "overhead" in report:
        fig, ax = plt.subplots(figsize=(8, 4))
        kinds = list(report["overhead"])
        ax.boxplot(
            [report["overhead"][k]["40"]["latencies_ms"] for k in kinds],
            tick_labels=kinds,
            showfliers=True,
        )
        ax.set_ylabel("latency per request (ms)")
        ax.set_title("rerank-server overhead: 40 candidates, instant backend")
        fig.tight_layout()
        fig.savefig(out / "bench-latency.png", dpi=100)
        written.append("bench-latency.png")
    if "throughput" in report:
        fig, ax = plt.subplots(figsize=(6, 4))
        for workers, by_clients in report["throughput"].items():
            clients = [int(c) for c in by_clients]
            ax.plot(
                clients,
                [by_clients[str(c)]["requests_per_s"] for c in clients],
                marker="o",
                label=f"{workers} worker{'s' if workers != '1' else ''}",
            )
        ax.legend()
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("requests/s (20 candidates each)")
        ax.set_title("throughput against an instant backend")
        fig.tight_layout()
        fig.savefig(out / "bench-throughput.png", dpi=100)
        written.append("bench-throughput.png")
    plt.close("all")
    return written


async def run(args: argparse.Namespace) -> dict[str, Any]:
    chosen = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = set(chosen) - set(SCENARIOS) - set(OPT_IN)
    if unknown:
        raise SystemExit(f"unknown scenarios: {', '.join(sorted(unknown))}")
    report: dict[str, Any] = {
        "machine": f"{platform.machine()}, {platform.python_implementation()} "
        f"{platform.python_version()}, {len(os.sched_getaffinity(0))} "
        "CPUs",
        "command": "rerank-server bench " + " ".join(sys.argv[2:]),
    }
    if "overhead" in chosen:
        report["overhead"] = await overhead(args.requests)
    if "telemetry" in chosen:
        with fake_backend() as url:
            report["telemetry"] = {
                kind: await telemetry_cost(
                    url, args.requests * 10, passages(TELEMETRY_CANDIDATES), kind
                )
                for kind in TELEMETRY_KINDS
            }
    if "throughput" in chosen:
        report["throughput"] = await throughput(
            args.seconds, [int(w) for w in args.workers.split(",")]
        )
    needs_llama = [s for s in ("model", "streaming", "backends") if s in chosen]
    if needs_llama:
        # An external backend (a GPU llama-server, vLLM, TEI) when given, else the cached
        # CPU build with the stand-in model.
        external = bool(args.backend_url)
        slots = args.slots if external else SLOTS
        label = f"{args.backend_url} ({args.backend})" if external else "llama-server"
        if external:
            report["backend_under_test"] = label
        with contextlib.nullcontext(args.backend_url) if external else llama_server(SLOTS) as llama:
            if "model" in chosen:
                report["model"] = await model(
                    llama,
                    args.rounds,
                    args.passages,
                    args.backend,
                    slots,
                    [int(n) for n in args.clients.split(",") if n],
                    args.seconds,
                    _eager_setting(args, external),
                )
            if "streaming" in chosen:
                report["streaming"] = await streaming(
                    llama,
                    args.rounds,
                    args.stream_latency_ms,
                    [int(n) for n in args.stream_sizes.split(",")],
                    args.backend,
                    slots,
                    "external" if external else label,
                )
            # chat against completion is a llama-server comparison of one model.
            if "backends" in chosen and args.backend == "chat":
                report["backends"] = await backends(llama, args.rounds, args.passages, slots)
    if "completion-options" in chosen:
        with (
            contextlib.nullcontext(args.backend_url)
            if args.backend_url
            else llama_server(SLOTS) as llama
        ):
            report["completion_options"] = await completion_options(
                llama, args.rounds, args.passages
            )
    if "settings" in chosen:
        grid = [tuple(int(v) for v in cell.split(":")) for cell in args.grid.split(",")]
        report["settings"] = await settings_grid(
            [(np, ub) for np, ub in grid], args.rounds, args.passages
        )
    return report


def _eager_setting(args: argparse.Namespace, external: bool) -> Eager:
    if args.no_eager:
        return Eager(skipped="--no-eager")
    cache = load([]).cache_dir
    model_path = args.eager_model or (
        None if external else assets.resolve_model(None, cache, fetch_missing=False)
    )
    if model_path is None:
        return Eager(skipped="--eager-model names the GGUF that --backend-url serves")
    python = args.eager_python or physical.torch_python(cache)
    if python is None:
        return Eager(
            skipped="no Python with torch and gguf (--eager-python, or "
            "`rerank-server prepare --speed-twin q8_0` builds one)"
        )
    return Eager(model_path, python)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rerank-server bench", description=__doc__.split("\n")[0])
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument(
        "--requests",
        type=int,
        default=100,
        help="overhead: requests per backend and size (telemetry: 10x)",
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=5.0,
        help="throughput and model --clients: seconds per level",
    )
    parser.add_argument(
        "--workers",
        default=",".join(map(str, sorted({1, os.cpu_count() or 1}))),
        help="throughput: the --workers settings to compare",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="llama-server scenarios: measured rounds (plus one warm-up)",
    )
    parser.add_argument(
        "--clients",
        default="",
        help="model scenario: also pairs/s with these many clients at "
        "once, each for --seconds, directly and through (e.g. 1,4,16)",
    )
    parser.add_argument(
        "--passages", type=int, default=20, help="llama-server scenarios: passages per request"
    )
    parser.add_argument(
        "--grid",
        default=",".join(f"{np}:{ub}" for np, ub in GRID),
        help="settings: llama-server -np:-ub cells",
    )
    parser.add_argument(
        "--stream-latency-ms",
        type=float,
        default=300.0,
        help="streaming: the fixed-latency backend's time per call",
    )
    parser.add_argument(
        "--stream-sizes",
        default=",".join(map(str, SIZES)),
        help="streaming: candidates per request",
    )
    parser.add_argument(
        "--backend-url",
        default="",
        help="model, streaming, backends: measure against this running "
        "backend instead of the cached llama-server build",
    )
    parser.add_argument(
        "--backend", default="chat", choices=DIRECT_KINDS, help="the kind of --backend-url"
    )
    parser.add_argument(
        "--slots",
        type=int,
        default=SLOTS,
        help="--backend-url's parallel slots: the concurrency of both "
        "the direct client and rerank-server",
    )
    parser.add_argument(
        "--eager-model",
        type=Path,
        default=None,
        help="model: the GGUF that --backend-url serves, for the physical "
        "limit (the stand-in when bench starts llama-server)",
    )
    parser.add_argument(
        "--eager-python",
        type=Path,
        default=None,
        help="model: a Python with torch and gguf for the physical limit "
        "(default: this one if it has them, else the converter's)",
    )
    parser.add_argument("--no-eager", action="store_true", help="model: skip the physical limit")
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    args = parser.parse_args(argv)
    if args.backend != "chat" and not args.backend_url:
        parser.error("--backend needs --backend-url (the cached build serves chat)")
    report = asyncio.run(run(args))
    args.out.mkdir(parents=True, exist_ok=True)
    report["plots"] = plots(report, args.out)
    (args.out / "bench.json").write_text(json.dumps(report, indent=1) + "\n")
    text = markdown(report)
    (args.out / "bench.md").write_text(text)
    print(text)
    return 0
