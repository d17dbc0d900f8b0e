"""`rerank-server eval DATASET`: BM25, then reranking per blend strategy, then metrics.

    rerank-server eval ../shared/data/trec_dl19_passage_subset --target 127.0.0.1:50051
    rerank-server eval DATA --server "--managed"        # start a server in-process

For every query with judgements: BM25 retrieves `--depth` documents (default 100); the best
`--rerank-depth` of them (default 20) go to the rerank-server once per strategy in
`--blend`, the rest keep their BM25 order behind them, so Recall@100 compares like with
like. ranx computes nDCG@10, Recall@10, Recall@100 and MRR@10 for BM25 and every
strategy, keeps the per-query values, and runs a paired two-sided t-test between every two
runs. Output: `OUT/eval-NAME.json` (everything, per query included) and `OUT/eval-NAME.md`
(the table; a letter after a value names each run it beats with p < 0.05).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rerank_client import AsyncRerankClient, Candidate, RerankError
from tqdm import tqdm

from .. import logs
from ..errors import ConfigError
from ..settings import LogFormat, load
from .beir import Dataset, DatasetError
from .beir import load as load_dataset
from .first_stage import Hit, bm25_top

METRICS = ("ndcg@10", "recall@10", "recall@100", "mrr@10")
STRATEGIES = ("position_aware", "linear", "rerank_only", "adaptive")
MAX_P = 0.05

Run = dict[str, dict[str, float]]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rerank-server eval", description=__doc__.split("\n")[0])
    p.add_argument("dataset", type=Path, help="folder in BEIR layout")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--target", help="a running rerank-server, HOST:PORT")
    where.add_argument("--server", default="",
                       help="start one in-process with these settings (flags as for "
                            "rerank-server, e.g. \"--managed\"); the default when no --target")
    p.add_argument("--depth", type=int, default=100, help="BM25 candidates per query")
    p.add_argument("--rerank-depth", type=int, default=20,
                   help="of those, how many are sent to be reranked")
    p.add_argument("--blend", default=",".join(STRATEGIES),
                   help="comma-separated blend strategies to evaluate")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    p.add_argument("--max-queries", type=int, default=0, help="first N queries only (0: all)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="deadline per request")
    p.add_argument("--out", type=Path, default=Path("bench-results"))
    p.add_argument("--name", default="", help="output name (default: the data set's)")
    return p


async def rerank_run(client: AsyncRerankClient, dataset: Dataset,
                     hits: dict[str, list[Hit]], strategy: str, rerank_depth: int,
                     concurrency: int, timeout_s: float,
                     ) -> tuple[Run, dict[str, int], tuple[str, str]]:
    """The run for one strategy, counts of how requests went, and (backend, model)."""
    slots = asyncio.Semaphore(concurrency)
    run: Run = {}
    counts = {"reranked": 0, "degraded": 0, "failed_pairs": 0}
    scorer = ("", "")
    bar = tqdm(total=len(hits), desc=strategy, unit="query", leave=False)

    async def one(qid: str) -> None:
        nonlocal scorer
        top, rest = hits[qid][:rerank_depth], hits[qid][rerank_depth:]
        candidates = [Candidate(id=h.document.id, text=h.document.text,
                                title=h.document.title or None, retrieval_score=h.score,
                                retrieval_rank=r) for r, h in enumerate(top, start=1)]
        async with slots:
            answer = await client.rerank(dataset.queries[qid], candidates, request_id=qid,
                                         blend_strategy=strategy, timeout=timeout_s,
                                         max_candidates=max(1, len(candidates)))
        counts["reranked" if answer.reranked else "degraded"] += 1
        counts["failed_pairs"] += answer.summary.failed
        if answer.reranked:
            scorer = (answer.summary.backend, answer.summary.model)
        ordered = [r.id for r in answer.results] + [h.document.id for h in rest]
        run[qid] = {doc: 1.0 / position for position, doc in enumerate(ordered, start=1)}
        bar.update()

    try:
        await asyncio.gather(*(one(q) for q in hits))
    finally:
        bar.close()
    return run, counts, scorer


def bm25_run(hits: dict[str, list[Hit]]) -> Run:
    return {q: {h.document.id: 1.0 / r for r, h in enumerate(hs, start=1)}
            for q, hs in hits.items()}


def score(dataset: Dataset, runs: dict[str, Run]) -> dict[str, Any]:
    """Means, per-query values and pairwise p-values for every run (ranx)."""
    from ranx import Qrels, compare, evaluate
    from ranx import Run as RanxRun

    qrels = Qrels(dataset.qrels)
    ranx_runs = []
    for name, run in runs.items():
        # ranx wants every judged query present; an empty ranking scores 0.
        complete = {q: run.get(q) or {"__none__": 0.0} for q in dataset.qrels}
        ranx_runs.append(RanxRun(complete, name=name))
    report = compare(qrels, ranx_runs, metrics=list(METRICS), stat_test="student",
                     max_p=MAX_P).to_dict()
    per_query = {r.name: {m: dict(zip(dataset.qrels, map(float, evaluate(
        qrels, r, m, return_mean=False)), strict=True)) for m in METRICS} for r in ranx_runs}
    return {"means": {n: report[n]["scores"] for n in runs},
            "p_values": {n: report[n]["comparisons"] for n in runs},
            "per_query": per_query}


def markdown(name: str, scores: dict[str, Any], header: str) -> str:
    names = list(scores["means"])
    letters = {n: chr(ord("a") + i) for i, n in enumerate(names)}
    lines = [f"### {name}", "", header, "",
             "| | run | " + " | ".join(m.replace("@", "@") for m in METRICS) + " |",
             "|---|---|" + "---|" * len(METRICS)]
    for n in names:
        cells = []
        for m in METRICS:
            value = scores["means"][n][m]
            beats = "".join(letters[o] for o in names if o != n
                            and scores["p_values"][n][o][m] < MAX_P
                            and value > scores["means"][o][m])
            cells.append(f"{value:.3f}" + (f" <sup>{beats}</sup>" if beats else ""))
        lines.append(f"| {letters[n]} | {n} | " + " | ".join(cells) + " |")
    lines += ["", f"A letter after a value: better than that run, paired two-sided t-test, "
                  f"p < {MAX_P}."]
    return "\n".join(lines) + "\n"


async def evaluate_dataset(args: argparse.Namespace) -> dict[str, Any]:
    dataset = load_dataset(args.dataset)
    if args.max_queries:
        keep = list(dataset.queries)[:args.max_queries]
        dataset = Dataset(dataset.name, dataset.corpus, {q: dataset.queries[q] for q in keep},
                          {q: dataset.qrels[q] for q in keep})
    started = time.perf_counter()
    hits = bm25_top(dataset, args.depth)
    runs: dict[str, Run] = {"bm25": bm25_run(hits)}
    server = None
    target = args.target
    if not target:
        from ..server import build_server

        # The server's own budget must not cut a long evaluation request short.
        settings = load(["--port", "0", "--timeout-ms", str(int(args.timeout_s * 1000)),
                         *shlex.split(args.server)])
        server = await build_server(settings)
        target = f"127.0.0.1:{server.port}"
    outcome: dict[str, dict[str, int]] = {}
    backend = model = ""
    try:
        async with AsyncRerankClient(target) as client:
            for strategy in [s.strip() for s in args.blend.split(",") if s.strip()]:
                runs[strategy], outcome[strategy], scorer = await rerank_run(
                    client, dataset, hits, strategy, args.rerank_depth, args.concurrency,
                    args.timeout_s)
                backend, model = scorer if scorer[0] else (backend, model)
    finally:
        if server is not None:
            await server.stop(grace=0)
    return {
        "dataset": dataset.name, "queries": len(dataset.queries),
        "documents": len(dataset.corpus), "depth": args.depth,
        "rerank_depth": args.rerank_depth, "backend": backend, "model": model,
        "requests": outcome, "seconds": round(time.perf_counter() - started, 1),
        "machine": f"{platform.machine()}, {platform.python_implementation()} "
                   f"{platform.python_version()}",
        **score(dataset, runs),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.configure("warning", LogFormat.JSON)
    try:
        result = asyncio.run(evaluate_dataset(args))
    except (DatasetError, ConfigError, RerankError) as exc:
        print(f"rerank-server eval: error: {exc}", file=sys.stderr)
        return 1
    name = args.name or result["dataset"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"eval-{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    header = (f"{result['queries']} queries, {result['documents']} documents; BM25 top "
              f"{result['depth']}, top {result['rerank_depth']} reranked by "
              f"`{result['backend']}` ({result['model']}).")
    table = markdown(name, result, header)
    (args.out / f"eval-{name}.md").write_text(table)
    print(table)
    for strategy, counts in result["requests"].items():
        if counts["degraded"] or counts["failed_pairs"]:
            print(f"warning: {strategy}: {counts['degraded']} of {result['queries']} "
                  f"requests not reranked, {counts['failed_pairs']} pairs failed "
                  "(the server log says why: timeouts, malformed answers)", file=sys.stderr)
    return 0
