"""`rerank-server eval DATASET`: BM25, then reranking per blend strategy, then metrics."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import platform
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rerank_client import AsyncRerankClient, RerankError
from tqdm import tqdm

from ..errors import ConfigError
from ..observability import logs
from ..settings import LogFormat, load
from .beir import Dataset, DatasetError
from .beir import load as load_dataset
from .first_stage import bm25_top
from .fit import ScoredQuery
from .json_out import without_nan
from .report import markdown, score
from .runs import Run, bm25_run, fit_profile, needle_rates, ranking_run, rerank_run, strategies

# The command's --help: what it runs, what it writes, with examples.
DESCRIPTION = """\
`rerank-server eval DATASET`: BM25, then reranking per blend strategy, then metrics.

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

STRATEGIES = ("position_aware", "linear", "rerank_only", "adaptive", "profile")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help with the defaults shown and the description's lines kept as written."""

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
        prog="rerank-server eval", description=DESCRIPTION, formatter_class=HelpFormatter
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
        "half of non-relevant ones; how often it reaches the top 3",
    )
    p.add_argument(
        "--needle-sizes",
        type=_sizes,
        default=(),
        metavar="N,N",
        help="candidates per needle request, comma-separated (default: --rerank-depth); "
        "the first is what `rerank-server fit` holds a profile to",
    )
    return p


def _sizes(raw: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in raw.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not whole numbers: {raw!r}") from None
    if not sizes or min(sizes) < 2:
        raise argparse.ArgumentTypeError("each size must be at least 2")
    return sizes


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
    needles: dict[int, dict[str, Any]] = {}
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
                for size in args.needle_sizes or (args.rerank_depth,):
                    needles[size] = await needle_rates(client, dataset, hits, args, size)
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
        # The first size's, with the scores a fit replays; then every size's rates.
        "needle": next(iter(needles.values()), None),
        "needles": {
            str(size): {k: v for k, v in n.items() if k != "scored"} for size, n in needles.items()
        },
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
