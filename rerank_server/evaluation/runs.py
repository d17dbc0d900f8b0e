"""The runs `eval` measures: BM25's, each strategy's through a rerank-server, the needle
case, and a profile fitted on the way."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rerank_client import AsyncRerankClient, Candidate
from tqdm import tqdm

from ..errors import ConfigError
from ..ranking import blend_profiles
from ..ranking.blend_profiles import BlendProfile, BlendProfiles
from ..ranking.scripts import dominant_script
from .beir import Dataset
from .first_stage import Hit
from .fit import ScoredQuery, fit, ndcg
from .needle import Needle, needles, rate

Run = dict[str, dict[str, float]]


def strategies(args: argparse.Namespace) -> list[str]:
    chosen = [s.strip() for s in args.blend.split(",") if s.strip()]
    # Fitting needs the reranker's scores, which any strategy's answers carry.
    return chosen or (["rerank_only"] if args.fit_profile else [])


@dataclass
class StrategyRun:
    """What one strategy's requests gave: the ranking, how they went, the raw scores."""

    run: Run
    counts: dict[str, int]
    scored: dict[str, ScoredQuery]  # per reranked query
    backend: str = ""
    model: str = ""
    blended_by: str = ""  # the strategy (and profile) the server says it blended with


async def rerank_run(
    client: AsyncRerankClient,
    dataset: Dataset,
    hits: dict[str, list[Hit]],
    strategy: str,
    rerank_depth: int,
    concurrency: int,
    timeout_s: float,
) -> StrategyRun:
    slots = asyncio.Semaphore(concurrency)
    out = StrategyRun(
        {}, {"reranked": 0, "degraded": 0, "no_reranker_weight": 0, "failed_pairs": 0}, {}
    )
    bar = tqdm(total=len(hits), desc=strategy, unit="query", leave=False)

    async def one(qid: str) -> None:
        top, rest = hits[qid][:rerank_depth], hits[qid][rerank_depth:]
        candidates = [
            Candidate(
                id=h.document.id,
                text=h.document.text,
                title=h.document.title or None,
                retrieval_score=h.score,
                retrieval_rank=r,
            )
            for r, h in enumerate(top, start=1)
        ]
        async with slots:
            answer = await client.rerank(
                dataset.queries[qid],
                candidates,
                request_id=qid,
                blend_strategy=strategy,
                timeout=timeout_s,
                max_candidates=max(1, len(candidates)),
            )
        # The blend gives the reranker no weight (a profile fitted to ignore this model):
        # the retrieval order is the answer, on purpose, without scoring.
        unneeded = answer.summary.degraded_code == "no_reranker_weight"
        out.counts[
            "reranked" if answer.reranked else "no_reranker_weight" if unneeded else "degraded"
        ] += 1
        out.counts["failed_pairs"] += answer.summary.failed
        if answer.reranked:
            out.backend, out.model = answer.summary.backend, answer.summary.model
            out.blended_by = " ".join(
                filter(None, (answer.summary.blend_strategy, answer.summary.blend_profile))
            )
            head = sorted(answer.results, key=lambda r: r.retrieval_rank)
            out.scored[qid] = ScoredQuery(
                qid,
                tuple(r.id for r in head),
                tuple(r.retrieval_rank for r in head),
                tuple(r.reranker_score for r in head),
                tuple(h.document.id for h in rest),
                dominant_script(dataset.queries[qid], (c.text for c in candidates)),
            )
        ordered = [r.id for r in answer.results] + [h.document.id for h in rest]
        out.run[qid] = ranking_run(ordered)
        bar.update()

    try:
        await asyncio.gather(*(one(q) for q in hits))
    finally:
        bar.close()
    return out


async def needle_run(
    client: AsyncRerankClient,
    dataset: Dataset,
    cases: Sequence[Needle],
    strategy: str,
    concurrency: int,
    timeout_s: float,
) -> tuple[list[list[str]], dict[str, dict[str, Any]]]:
    """Each needle request's answer (ids in order) under `strategy`, and the model's
    scores per query in retrieval order (`always_score`: a blend that gives the model no
    weight still reports them)."""
    slots = asyncio.Semaphore(concurrency)
    answers: list[list[str]] = [[] for _ in cases]
    scored: dict[str, dict[str, Any]] = {}

    async def one(i: int, case: Needle) -> None:
        candidates = [
            Candidate(id=d.id, text=d.text, title=d.title or None, retrieval_rank=r)
            for r, d in enumerate(case.documents, 1)
        ]
        async with slots:
            answer = await client.rerank(
                dataset.queries[case.qid],
                candidates,
                request_id=f"needle-{case.qid}",
                blend_strategy=strategy,
                timeout=timeout_s,
                max_candidates=len(candidates),
                always_score=True,
            )
        answers[i] = [r.id for r in answer.results]
        head = sorted(answer.results, key=lambda r: r.retrieval_rank)
        scored[case.qid] = {
            "ids": [r.id for r in head],
            "needle": case.needle,
            "scores": [r.reranker_score for r in head],
            "script": dominant_script(dataset.queries[case.qid], (d.text for d in case.documents)),
        }

    await asyncio.gather(*(one(i, c) for i, c in enumerate(cases)))
    return answers, scored


async def needle_rates(
    client: AsyncRerankClient,
    dataset: Dataset,
    hits: dict[str, list[Hit]],
    args: argparse.Namespace,
    size: int,
) -> dict[str, Any]:
    """The needle case at `size` candidates under every strategy evaluated (`needle.py`)."""
    cases = needles(dataset, hits, size)
    rates: dict[str, float] = {}
    scored: dict[str, dict[str, Any]] = {}
    for strategy in strategies(args):
        answers, scored = await needle_run(
            client, dataset, cases, strategy, args.concurrency, args.timeout_s
        )
        rates[strategy] = rate([c.needle for c in cases], answers)
    return {"queries": len(cases), "size": size, "top": 3, "rates": rates, "scored": scored}


def ranking_run(ordered: Sequence[str]) -> dict[str, float]:
    """A ranking as ranx wants it: higher is better."""
    return {doc: 1.0 / position for position, doc in enumerate(ordered, start=1)}


def fit_profile(
    args: argparse.Namespace,
    dataset: Dataset,
    scored: dict[str, ScoredQuery],
    backend: str,
    model: str,
    runs: dict[str, Run],
) -> dict[str, Any]:
    """Fit a profile on this data set's scores and write it into `args.fit_profile`."""
    if not scored or not backend or not model:
        raise ConfigError(
            "--fit-profile: no request was reranked (or the server did not "
            "name its model), so there is nothing to fit"
        )
    queries = [scored[q] for q in sorted(scored)]
    result = fit(queries, dataset.qrels, folds=args.folds)
    fitted = {
        "dataset": dataset.name,
        "queries": len(queries),
        "depth": args.depth,
        "rerank_depth": args.rerank_depth,
        "folds": args.folds,
        "grid": result.grid_size,
        "model": model,
        "objective": "ndcg@10",
        "ndcg@10": {
            "in_sample": round(result.in_sample, 4),
            "cross_validated": round(result.cross_validated, 4),
            **{
                name: round(
                    statistics.fmean(
                        fit_ndcg(run.get(q.qid, {}), dataset.qrels[q.qid]) for q in queries
                    ),
                    4,
                )
                for name, run in runs.items()
                if name in ("bm25", "rerank_only")
            },
        },
        "fold_params": [dataclasses.asdict(p) for p in result.fold_params],
        "date": time.strftime("%Y-%m-%d"),
    }
    name = args.profile_name or f"{backend}-{model.removesuffix('.gguf')}"
    profile = BlendProfile(name, backend, args.profile_model or model, result.params, fitted)
    target: Path = args.fit_profile
    existing = blend_profiles.load(target) if target.exists() else BlendProfiles((), str(target))
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(existing.with_profile(profile).to_json(), indent=1) + "\n")
    return {"profile": profile.to_json(), "file": str(target), "out_of_fold": result.out_of_fold}


def fit_ndcg(run: dict[str, float], judged: dict[str, int]) -> float:
    return ndcg(sorted(run, key=lambda d: -run[d]), judged)


def bm25_run(hits: dict[str, list[Hit]]) -> Run:
    return {q: ranking_run([h.document.id for h in hs]) for q, hs in hits.items()}
