"""`eval`'s figures: ranx metrics and paired tests per run, and their Markdown."""

from __future__ import annotations

import math
import warnings
from typing import Any

from .beir import Dataset
from .runs import Run

METRICS = ("ndcg@10", "recall@10", "recall@100", "mrr@10")
MAX_P = 0.05


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
    needles = scores.get("needles") or (
        {str(scores["needle"].get("size", 20)): scores["needle"]} if scores.get("needle") else {}
    )
    for size, needle in needles.items():
        n = int(size)
        rates = needle["rates"]
        base = rates.get("rerank_only")
        shares = ", ".join(
            f"{s} {r:.2f}"
            + (f" ({r / base:.0%} of rerank_only)" if base and s != "rerank_only" else "")
            for s, r in rates.items()
        )
        lines += [
            "",
            f"Needle case at {n} candidates ({needle['queries']} queries: a relevant "
            f"document at retrieval rank {n // 2 + 1}-{n} under {n - 1} non-relevant "
            f"ones), how often it reaches the top {needle['top']}: {shares}.",
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
