"""The other scenarios: overhead against an instant fake, throughput, streaming, the
llama-server settings grid, completion options and chat against completion."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

import httpx
from rerank_client import AsyncRerankClient, RerankError, Result, Summary

from ..scoring.backends import prompt
from ..settings import DEFAULT_INSTRUCTION
from . import replay
from .common import CLIENTS, KINDS, SIZES, SLOTS, ms_stats, passages, pct, timed
from .processes import bare_grpc, cpu_seconds, fake_backend, llama_server, rerank_server

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
                direct.append(await timed(backend.run))
                floor.append(await timed(partial(bare.rerank, f"q {i}", docs)))
            through.append(await timed(partial(client.rerank, f"q {i}", docs)))
            if not i % 2:
                floor.append(await timed(partial(bare.rerank, f"q {i}", docs)))
                direct.append(await timed(backend.run))
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
    times = ms_stats(through)
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
        **ms_stats(latencies),
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
                            t = await timed(partial(client.rerank, query, docs))
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
                    t = await timed(partial(client.rerank, query, docs))
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
