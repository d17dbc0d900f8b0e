"""`rerank-server fit EVAL.json...`: a blend profile fitted across data sets."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
import warnings
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..ranking import blend_profiles
from ..ranking.blend_profiles import BlendProfile, BlendProfiles
from ..ranking.blending import AdaptiveParams
from .fit import Family, ScoredQuery
from .fit_across import Choice, Collection, Constraint, CrossFit, NeedleQuery, fit_across
from .json_out import without_nan
from .report import p_value
from .run import HelpFormatter

# The command's --help: how the parameters are chosen, and the options that constrain them.
DESCRIPTION = """\
`rerank-server fit EVAL.json...`: a blend profile fitted across data sets.

    rerank-server eval $D/trec_dl19_passage_subset --name trec-minilm --server "$M"
    rerank-server eval $D/vaswani_npl --name vaswani-minilm --server "$M"
    rerank-server fit bench-results/eval-trec-minilm.json bench-results/eval-vaswani-minilm.json \
        --fit-profile profiles.json --profile-name minilm-l6 --profile-model 'all-MiniLM-L6-v2*'

Each `eval-NAME.json` keeps the reranker's raw scores per query and the judgements, so
the fit replays them offline (`fit.fit_across`): no server, no model. The parameters are
chosen by their worst data set, and every data set is also held out in turn and scored
with the parameters fitted on the others (leave-one-collection-out). The table
(`OUT/fit-NAME.md`, everything in `OUT/fit-NAME.json`) shows, per data set, BM25, the
pure reranking (`rerank_only`), the held-out profile and the profile fitted on everything, with
the share of pure reranking's gain each keeps and paired two-sided t-test p-values.

With `--profile-scripts Latin` the profile's model is taken to read only that script:
requests mostly in another get no weight, in the fit as in the server. With
`--needle-share 0.9` (evaluations run with `--needle`) a choice must also bring the
needle into the top 3 at least 0.9 times as often as `rerank_only` on every data set
whose needle requests its model reads.
"""


class FitError(Exception):
    """An input the fit cannot use; the message names the file and what is wrong."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rerank-server fit", description=DESCRIPTION, formatter_class=HelpFormatter
    )
    p.add_argument(
        "evals",
        nargs="+",
        type=Path,
        metavar="EVAL.json",
        help="outputs of rerank-server eval, one per data set, same backend and model",
    )
    p.add_argument(
        "--family",
        type=Family,
        choices=list(Family),
        default=Family.GATE,
        help="which parameters the fit may choose (docs/blending.md)",
    )
    p.add_argument(
        "--fit-profile",
        type=Path,
        metavar="FILE",
        help="write the profile fitted on every data set into FILE (other profiles there are kept)",
    )
    p.add_argument("--profile-name", default="", help="default: BACKEND-MODEL")
    p.add_argument(
        "--profile-model",
        default="",
        help="model pattern the profile applies to (default: exactly the served model's name)",
    )
    p.add_argument(
        "--profile-scripts",
        default="",
        help="comma-separated scripts the model reads, e.g. Latin: requests "
        "mostly in another get no weight (docs/blending.md)",
    )
    p.add_argument(
        "--needle-share",
        type=float,
        default=0.0,
        help="a choice must bring the needle into the top 3 at least this share "
        "as often as rerank_only, per data set (evaluations with --needle)",
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=0.005,
        help="nDCG@10: choices whose worst shortfall is within this of the least are "
        "equal, and the best mean decides among them (0: the least shortfall alone)",
    )
    p.add_argument("--out", type=Path, default=Path("bench-results"))
    p.add_argument("--name", default="", help="output name (default: the profile's)")
    return p


def read(path: Path) -> tuple[Collection, str, str]:
    """One `eval-NAME.json`: the collection, and the backend and model that scored it."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise FitError(f"{path}: cannot read it as JSON: {exc}") from None
    if not isinstance(data, dict) or not data.get("scored") or "qrels" not in data:
        raise FitError(
            f"{path}: no reranked queries with judgements in it (written by "
            "rerank-server eval of this version, with at least one query "
            "reranked?)"
        )
    queries = tuple(ScoredQuery.from_json(q, v) for q, v in sorted(data["scored"].items()))
    needles = tuple(
        NeedleQuery(
            ScoredQuery(
                q,
                tuple(v["ids"]),
                tuple(range(1, len(v["ids"]) + 1)),
                tuple(v["scores"]),
                (),
                str(v.get("script", "")),
            ),
            v["needle"],
        )
        for q, v in sorted(((data.get("needle") or {}).get("scored") or {}).items())
    )
    name = str(data.get("dataset") or path.stem)
    return (
        Collection(name, queries, data["qrels"], needles, dataset=name),
        str(data.get("backend", "")),
        str(data.get("model", "")),
    )


def t_test(a: Sequence[float], b: Sequence[float]) -> float:
    """Paired two-sided t-test p-value; NaN when the two agree on every query."""
    if all(x == y for x, y in zip(a, b, strict=True)):
        return math.nan
    from scipy.stats import ttest_rel

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Precision loss occurred", RuntimeWarning)
        return float(ttest_rel(a, b).pvalue)


def describe(params: AdaptiveParams) -> str:
    if params.max_weight == 0.0:
        return "retrieval order"
    weight = (
        f"{params.max_weight:g}"
        if params.min_weight == params.max_weight
        else f"{params.min_weight:g}→{params.max_weight:g} over spread "
        f"{params.spread_noise:g}–{params.spread_decisive:g}"
    )
    gate = (
        f", gated by best score {params.top_floor:g}–{params.top_full:g}"
        if params.top_full > 0.0
        else ""
    )
    return f"weight {weight}{gate}"


def row(name: str, result: CrossFit, choice: Choice) -> dict[str, Any]:
    """One collection under one choice: mean nDCG@10, share of gain, p-values."""
    values, bm25, reranker = choice.per_query[name], result.bm25[name], result.reranker[name]
    mean, base, top = (statistics.fmean(v) for v in (values, bm25, reranker))
    return {
        "ndcg@10": round(mean, 4),
        "vs_bm25": round(mean - base, 4),
        "p_bm25": t_test(values, bm25),
        "vs_reranker": round(mean - top, 4),
        "p_reranker": t_test(values, reranker),
        "share_of_gain": round((mean - base) / (top - base), 3) if top > base else None,
        "params": dataclasses.asdict(choice.params),
        "fitted_on": list(choice.fitted_on),
    }


def report(result: CrossFit, collections: Sequence[Collection]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for c in collections:
        name = c.name
        out[name] = {
            "queries": len(result.bm25[name]),
            "bm25": round(statistics.fmean(result.bm25[name]), 4),
            "reranker": round(statistics.fmean(result.reranker[name]), 4),
            "fitted_on_all": row(name, result, result.everything),
        }
        if name in result.held_out:
            out[name]["held_out"] = row(name, result, result.held_out[name])
        if c.needles:
            out[name]["needle"] = {
                "requests": len(c.needles),
                "read": len(c.read_needles(result.scripts)),
                "rerank_only": round(c.needle_reranked(), 3),
                "fitted_on_all": round(c.needle_rate(result.everything.params, result.scripts), 3),
            }
    return out


def markdown(title: str, rows: dict[str, Any], result: CrossFit, header: str) -> str:
    def cell(r: dict[str, Any]) -> str:
        share = "" if r["share_of_gain"] is None else f", {r['share_of_gain']:.0%} of gain"
        return (
            f"{r['ndcg@10']:.3f} ({r['vs_bm25']:+.3f} vs BM25, p {p_value(r['p_bm25'])}; "
            f"{r['vs_reranker']:+.3f} vs rerank_only, p {p_value(r['p_reranker'])}{share})"
        )

    lines = [
        f"### {title}",
        "",
        header,
        "",
        "| data set | queries | BM25 | rerank_only | held out (fitted on the others)"
        " | fitted on all |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        held = cell(r["held_out"]) if "held_out" in r else "–"
        lines.append(
            f"| {name} | {r['queries']} | {r['bm25']:.3f} | {r['reranker']:.3f} | "
            f"{held} | {cell(r['fitted_on_all'])} |"
        )
    needles = [(name, r["needle"]) for name, r in rows.items() if "needle" in r]
    if needles:
        lines += [
            "",
            "Needle case (a relevant document at retrieval rank 11-20, in the top "
            "3), fitted on all against rerank_only: "
            + "; ".join(
                f"{name} {n['fitted_on_all']:.2f} / {n['rerank_only']:.2f}"
                + (
                    ""
                    if n["read"] == n["requests"]
                    else f" ({n['read']} of {n['requests']} requests in a script the model reads)"
                )
                for name, n in needles
            )
            + ".",
        ]
        if result.needle_share:
            lines.append(
                f"Asked: at least {result.needle_share:g} of rerank_only's rate "
                "where the model reads the requests; "
                + ("met." if result.needle_met else "**not met** by any choice.")
            )
    scripts = f"; reads {', '.join(result.scripts)} only" if result.scripts else ""
    lines += [
        "",
        "Parameters:",
        "",
        f"- fitted on all: {describe(result.everything.params)}{scripts}",
    ]
    lines += [
        f"- held out {name}: {describe(choice.params)}" for name, choice in result.held_out.items()
    ]
    return "\n".join(lines) + "\n"


def write_profile(
    args: argparse.Namespace, result: CrossFit, rows: dict[str, Any], backend: str, model: str
) -> str:
    name = args.profile_name or f"{backend}-{model.removesuffix('.gguf')}"
    fitted = {
        "method": "rerank-server fit: worst data set's shortfall from the better of BM25 "
        "and pure reranking (rerank_only), nDCG@10; leave-one-collection-out"
        + (
            f"; needle case at least {result.needle_share:g} of rerank_only's"
            if result.needle_share
            else ""
        ),
        "family": str(args.family),
        "grid": result.grid_size,
        "model": model,
        "date": time.strftime("%Y-%m-%d"),
        "collections": {
            c: {
                "queries": r["queries"],
                "bm25": r["bm25"],
                "reranker": r["reranker"],
                "fitted": r["fitted_on_all"]["ndcg@10"],
                "held_out": r.get("held_out", {}).get("ndcg@10"),
                **({"needle": r["needle"]} if "needle" in r else {}),
            }
            for c, r in rows.items()
        },
    }
    profile = BlendProfile(
        name, backend, args.profile_model or model, result.everything.params, fitted, result.scripts
    )
    target: Path = args.fit_profile
    existing = blend_profiles.load(target) if target.exists() else BlendProfiles((), str(target))
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(existing.with_profile(profile).to_json(), indent=1) + "\n")
    return name


def _by_depth(
    inputs: list[tuple[Collection, str, str]],
) -> list[tuple[Collection, str, str]]:
    """A data set given at several reranking depths is named `NAME@DEPTH` in each: fitted
    at both, held out at both."""
    counts = Counter(c.name for c, _, _ in inputs)
    return [
        (
            dataclasses.replace(
                c, name=f"{c.name}@{max(len(q.ids) for q in c.queries)}", dataset=c.source
            )
            if counts[c.name] > 1
            else c,
            backend,
            model,
        )
        for c, backend, model in inputs
    ]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        inputs = [read(path) for path in args.evals]
        scorers = {(backend, model) for _, backend, model in inputs}
        if len(scorers) != 1:
            raise FitError(
                "the evaluations were scored by different backends or models "
                f"({', '.join(sorted(f'{b} {m}' for b, m in scorers))}): a "
                "profile is for one of them"
            )
        inputs = _by_depth(inputs)
        names = [c.name for c, _, _ in inputs]
        if len(set(names)) != len(names):
            raise FitError(f"a data set is given twice at one depth: {', '.join(names)}")
    except FitError as exc:
        print(f"rerank-server fit: error: {exc}", file=sys.stderr)
        return 1
    backend, model = scorers.pop()
    depth = {len(q.ids) for c, _, _ in inputs for q in c.queries}
    collections = [c for c, _, _ in inputs]
    scripts = tuple(s.strip() for s in args.profile_scripts.split(",") if s.strip())
    result = fit_across(
        collections, args.family, Constraint(args.needle_share, scripts), args.tolerance
    )
    rows = report(result, collections)
    title = args.name or args.profile_name or f"{backend}-{model}"
    header = (
        f"`{backend}` ({model}); family `{args.family}` ({result.grid_size} "
        f"candidates); up to {max(depth)} candidates reranked per query; nDCG@10 "
        "replayed exactly as the server blends. p: paired two-sided t-test over "
        'queries ("same ranking": identical rankings).'
    )
    table = markdown(title, rows, result, header)
    if args.fit_profile:
        written = write_profile(args, result, rows, backend, model)
        table += f"\nProfile `{written}` (fitted on all) written to `{args.fit_profile}`.\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"fit-{title}.md").write_text(table)
    (args.out / f"fit-{title}.json").write_text(
        json.dumps(
            {
                "backend": backend,
                "model": model,
                "family": str(args.family),
                "grid": result.grid_size,
                "collections": without_nan(rows),
            },
            indent=1,
            allow_nan=False,
        )
        + "\n"
    )
    print(table)
    return 0
