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

With `--needle` it also runs the needle case (`needle.py`) through every strategy: how
often a relevant document that retrieval placed in the second half of 20 comes up into
the top 3, each strategy's rate beside `rerank_only`'s.

With `--fit-profile FILE` it also fits a blend profile for the server's backend and model
on this data set (`fit.py`), adds the cross-validated run `profile_cv` to the table and
writes the profile into FILE (other profiles in it are kept):

    rerank-server eval DATA --server "..." --fit-profile profiles.json
    rerank-server eval OTHER --server "... --blend-profile profiles.json" \
        --blend rerank_only,adaptive,profile
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import io
import json
import math
import platform
import shlex
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rerank_client import AsyncRerankClient, Candidate, RerankError
from tqdm import tqdm

from ..errors import ConfigError
from ..observability import logs
from ..ranking import blend_profiles
from ..ranking.blend_profiles import BlendProfile, BlendProfiles
from ..ranking.scripts import dominant_script
from ..settings import LogFormat, load
from .beir import Dataset, DatasetError
from .beir import load as load_dataset
from .first_stage import Hit, bm25_top
from .fit import ScoredQuery, fit, ndcg
from .json_out import without_nan
from .needle import Needle, needles, rate

METRICS = ("ndcg@10", "recall@10", "recall@100", "mrr@10")
STRATEGIES = ("position_aware", "linear", "rerank_only", "adaptive", "profile")
MAX_P = 0.05

Run = dict[str, dict[str, float]]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def _strategy_list(raw: str) -> str:
    """`--blend`: checked before any work, so a typo does not cost an evaluation."""
    unknown = [s for s in (x.strip() for x in raw.split(",")) if s and s not in STRATEGIES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown strategy {', '.join(unknown)}; choose from {', '.join(STRATEGIES)}"
        )
    return raw


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rerank-server eval", description=__doc__, formatter_class=HelpFormatter
    )
    p.add_argument("dataset", type=Path, help="folder in BEIR layout")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--target", help="a running rerank-server, HOST:PORT")
    where.add_argument(
        "--server",
        default="",
        help="start one in-process with these settings (flags as for "
        'rerank-server, e.g. "--managed"); the default when no --target',
    )
    p.add_argument("--depth", type=int, default=100, help="BM25 candidates per query")
    p.add_argument(
        "--rerank-depth", type=int, default=20, help="of those, how many are sent to be reranked"
    )
    p.add_argument(
        "--blend",
        default=",".join(STRATEGIES),
        type=_strategy_list,
        help=f"comma-separated blend strategies to evaluate; choose from {', '.join(STRATEGIES)}",
    )
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    p.add_argument("--max-queries", type=int, default=0, help="first N queries only (0: all)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="deadline per request")
    p.add_argument("--out", type=Path, default=Path("bench-results"))
    p.add_argument("--name", default="", help="output name (default: the data set's)")
    p.add_argument(
        "--fit-profile",
        type=Path,
        metavar="FILE",
        help="fit a blend profile for the server's backend and model on this data "
        "set and write it into FILE (other profiles there are kept)",
    )
    p.add_argument(
        "--profile-name", default="", help="name of the fitted profile (default: BACKEND-MODEL)"
    )
    p.add_argument(
        "--profile-model",
        default="",
        help="model pattern the profile applies to, e.g. 'all-MiniLM-L6-v2*' "
        "(default: exactly the served model's name)",
    )
    p.add_argument("--folds", type=int, default=5, help="cross-validation folds for the fit")
    p.add_argument(
        "--needle",
        action="store_true",
        help="also run the needle case: a relevant document placed in the second "
        "half of 20 non-relevant ones; how often it reaches the top 3",
    )
    return p


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
) -> dict[str, Any]:
    """The needle case under every strategy evaluated (`needle.py`)."""
    cases = needles(dataset, hits)
    rates: dict[str, float] = {}
    scored: dict[str, dict[str, Any]] = {}
    for strategy in strategies(args):
        answers, scored = await needle_run(
            client, dataset, cases, strategy, args.concurrency, args.timeout_s
        )
        rates[strategy] = rate([c.needle for c in cases], answers)
    return {"queries": len(cases), "top": 3, "rates": rates, "scored": scored}


def ranking_run(ordered: Sequence[str]) -> dict[str, float]:
    """A ranking as ranx wants it: higher is better."""
    return {doc: 1.0 / position for position, doc in enumerate(ordered, start=1)}


def strategies(args: argparse.Namespace) -> list[str]:
    chosen = [s.strip() for s in args.blend.split(",") if s.strip()]
    # Fitting needs the reranker's scores, which any strategy's answers carry.
    return chosen or (["rerank_only"] if args.fit_profile else [])


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
    with warnings.catch_warnings():
        # Expected here, not news for the reader: a blend that keeps BM25's ranking gives
        # two identical runs (scipy: "precision loss ... nearly identical"), and ranx's
        # compiled metrics warn, when numba compiles them, about their own integer cast
        # (a message numba may wrap in terminal escapes, hence the leading ".*").
        warnings.filterwarnings("ignore", "Precision loss occurred", RuntimeWarning)
        warnings.filterwarnings("ignore", ".*unsafe cast from uint64 to int64")
        report = compare(
            qrels, ranx_runs, metrics=list(METRICS), stat_test="student", max_p=MAX_P
        ).to_dict()
        # ranx returns per-query values in its own (sorted) query order, not the data set's.
        order = list(qrels.keys())
        per_query = {
            r.name: {
                m: dict(
                    zip(order, map(float, evaluate(qrels, r, m, return_mean=False)), strict=True)
                )
                for m in METRICS
            }
            for r in ranx_runs
        }
    return {
        "means": {n: report[n]["scores"] for n in runs},
        "p_values": {n: report[n]["comparisons"] for n in runs},
        "per_query": per_query,
    }


def markdown(name: str, scores: dict[str, Any], header: str) -> str:
    names = list(scores["means"])
    letters = {n: chr(ord("a") + i) for i, n in enumerate(names)}
    lines = [
        f"### {name}",
        "",
        header,
        "",
        "| | run | " + " | ".join(m.replace("@", "@") for m in METRICS) + " |",
        "|---|---|" + "---|" * len(METRICS),
    ]
    for n in names:
        cells = []
        for m in METRICS:
            value = scores["means"][n][m]
            beats = "".join(
                letters[o]
                for o in names
                if o != n and scores["p_values"][n][o][m] < MAX_P and value > scores["means"][o][m]
            )
            cells.append(f"{value:.3f}" + (f" <sup>{beats}</sup>" if beats else ""))
        lines.append(f"| {letters[n]} | {n} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"A letter after a value: better than that run, paired two-sided t-test, p < {MAX_P}.",
        "",
    ]
    lines += against_baselines(scores)
    needle = scores.get("needle")
    if needle:
        rates = needle["rates"]
        base = rates.get("rerank_only")
        shares = ", ".join(
            f"{s} {r:.2f}"
            + (f" ({r / base:.0%} of rerank_only)" if base and s != "rerank_only" else "")
            for s, r in rates.items()
        )
        lines += [
            "",
            f"Needle case ({needle['queries']} queries: a relevant document at "
            f"retrieval rank 11-20 under 19 non-relevant ones), how often it "
            f"reaches the top {needle['top']}: {shares}.",
        ]
    fitted = scores.get("fit")
    if fitted:
        prof, how = fitted["profile"], fitted["profile"]["fitted"]
        lines += [
            "",
            f"Fitted profile `{prof['name']}` (model `{prof['model']}`): "
            f"reranker weight {prof['min_weight']:g} at a score spread up to "
            f"{prof['spread_noise']:g}, {prof['max_weight']:g} from "
            f"{prof['spread_decisive']:g}; nDCG@10 {how['ndcg@10']['in_sample']:.3f} "
            f"in sample, {how['ndcg@10']['cross_validated']:.3f} cross-validated "
            f"({how['folds']} folds by query, run `profile_cv`); written to "
            f"`{fitted['file']}`.",
        ]
    return "\n".join(lines) + "\n"


def p_value(p: float) -> str:
    # ranx gives NaN when two runs agree on every query: there is no difference to test.
    return "same ranking" if math.isnan(p) else f"{p:.3f}"


def against_baselines(scores: dict[str, Any], metric: str = "ndcg@10") -> list[str]:
    """nDCG@10 of each run against BM25 and pure rerank, with paired p-values, and the
    share of pure rerank's gain over BM25 it keeps."""
    means, p = scores["means"], scores["p_values"]
    if "bm25" not in means:
        return []
    base = means["bm25"][metric]
    rerank = means.get("rerank_only", {}).get(metric)
    lines = [
        f"| run | {metric} | vs bm25 | p | vs rerank_only | p | share of rerank gain |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in means:
        if n == "bm25":
            continue
        value = means[n][metric]
        cells = [n, f"{value:.3f}", f"{value - base:+.3f}", p_value(p[n]["bm25"][metric])]
        if rerank is None or n == "rerank_only":
            cells += ["", "", ""]
        else:
            gain = rerank - base
            cells += [
                f"{value - rerank:+.3f}",
                p_value(p[n]["rerank_only"][metric]),
                f"{(value - base) / gain:.0%}" if gain > 0 else "n/a",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


async def evaluate_dataset(args: argparse.Namespace) -> dict[str, Any]:
    dataset = load_dataset(args.dataset)
    if args.max_queries:
        keep = list(dataset.queries)[: args.max_queries]
        dataset = Dataset(
            dataset.name,
            dataset.corpus,
            {q: dataset.queries[q] for q in keep},
            {q: dataset.qrels[q] for q in keep},
        )
    hits = bm25_top(dataset, args.depth)
    runs: dict[str, Run] = {"bm25": bm25_run(hits)}
    server = None
    target = args.target
    if not target:
        from ..server import build_server

        # The server's own budget must not cut a long evaluation request short.
        settings = load(
            [
                "--port",
                "0",
                "--timeout-ms",
                str(int(args.timeout_s * 1000)),
                "--http-port",
                "0",
                *shlex.split(args.server),
            ]
        )
        server = await build_server(settings)
        target = f"127.0.0.1:{server.port}"
    outcome: dict[str, dict[str, int]] = {}
    backend = model = ""
    scored: dict[str, ScoredQuery] = {}
    blended_by: dict[str, str] = {}
    needle = None
    try:
        async with AsyncRerankClient(target) as client:
            for strategy in strategies(args):
                done = await rerank_run(
                    client,
                    dataset,
                    hits,
                    strategy,
                    args.rerank_depth,
                    args.concurrency,
                    args.timeout_s,
                )
                runs[strategy], outcome[strategy] = done.run, done.counts
                backend, model = (done.backend, done.model) if done.backend else (backend, model)
                scored = scored or done.scored
                blended_by[strategy] = done.blended_by
            if args.needle:
                needle = await needle_rates(client, dataset, hits, args)
    finally:
        if server is not None:
            await server.stop(grace=0)
    print(
        f"computing metrics and paired significance tests for {len(runs)} runs...", file=sys.stderr
    )
    fitted = None
    if args.fit_profile:
        fitted = fit_profile(args, dataset, scored, backend, model, runs)
        runs["profile_cv"] = {
            qid: ranking_run(ordered) for qid, ordered in fitted.pop("out_of_fold").items()
        }
    return {
        "dataset": dataset.name,
        "queries": len(dataset.queries),
        "documents": len(dataset.corpus),
        "depth": args.depth,
        "rerank_depth": args.rerank_depth,
        "backend": backend,
        "model": model,
        "requests": outcome,
        "blended_by": blended_by,
        "fit": fitted,
        "needle": needle,
        # The model's raw scores per reranked query and their judgements: what a profile
        # is fitted on, kept so that `rerank-server fit` replays fits across data sets.
        "scored": {qid: sq.to_json() for qid, sq in scored.items()},
        "qrels": {qid: dataset.qrels[qid] for qid in scored},
        "machine": f"{platform.machine()}, {platform.python_implementation()} "
        f"{platform.python_version()}",
        **score(dataset, runs),
    }


class _AboveTheBar(io.TextIOBase):
    """A text stream that prints above tqdm's progress bars instead of through them."""

    def write(self, text: str) -> int:
        if text.strip():
            tqdm.write(text.rstrip("\n"), file=sys.stderr)
        return len(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return False


def main(argv: Sequence[str] | None = None) -> int:
    started = time.perf_counter()
    args = build_parser().parse_args(argv)
    logs.configure("warning", LogFormat.JSON, stream=_AboveTheBar())
    try:
        result = asyncio.run(evaluate_dataset(args))
    except (DatasetError, ConfigError, RerankError) as exc:
        print(f"rerank-server eval: error: {exc}", file=sys.stderr)
        return 1
    if not any(
        counts["reranked"] or counts["no_reranker_weight"] for counts in result["requests"].values()
    ):
        print(
            f"rerank-server eval: error: no pair was scored ({result['queries']} queries "
            f"per strategy, all answered in BM25 order): is the backend up, at the right "
            f"URL, and of the --backend kind it speaks? The server log says why.",
            file=sys.stderr,
        )
        return 1
    result["seconds"] = round(time.perf_counter() - started, 1)  # the whole run
    name = args.name or result["dataset"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"eval-{name}.json").write_text(
        json.dumps(without_nan(result), indent=1, allow_nan=False) + "\n"
    )
    header = (
        f"{result['queries']} queries, {result['documents']} documents; BM25 top "
        f"{result['depth']}, top {result['rerank_depth']} reranked by "
        f"`{result['backend']}` ({result['model']})."
    )
    used = {s: by for s, by in result["blended_by"].items() if by and by != s}
    if used:
        header += " Blended by: " + ", ".join(f"{s} as `{by}`" for s, by in used.items()) + "."
    table = markdown(name, result, header)
    (args.out / f"eval-{name}.md").write_text(table)
    print(table)
    for strategy, counts in result["requests"].items():
        if counts["degraded"] or counts["failed_pairs"]:
            print(
                f"warning: {strategy}: {counts['degraded']} of {result['queries']} "
                f"requests not reranked, {counts['failed_pairs']} pairs failed "
                "(the server log says why: timeouts, malformed answers)",
                file=sys.stderr,
            )
    return 0
