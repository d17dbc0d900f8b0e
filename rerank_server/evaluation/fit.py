"""Fitting a blend profile: the request-wide blend's parameters for one scorer.

The reranker's scores are fetched once per query; every candidate parameter set is then
replayed offline through `blending.adaptive_scores`, the very function the server blends
with, so a fitted profile orders answers exactly as it did here. The objective is mean
nDCG@10 (Järvelin-Kekäläinen gains, as ranx computes it).

The grid: spread thresholds at the deciles of this data set's per-request spreads
(so it adapts to how far apart each model's scores lie) and reranker weights on a quarter
grid. Ties go to the grid's first entry, and the grid lists the cautious settings
(low reranker weight) first: a scorer with no signal is fitted to the retrieval order.

Cross-validation is by query: each fold's queries are blended with the parameters fitted
on the other folds. The mean over those out-of-fold rankings estimates what the profile
will do on unseen queries; the profile itself is fitted on every query.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..ranking.blending import AdaptiveParams, adaptive_scores, spread

WEIGHT_LEVELS = (0.0, 0.25, 0.5, 0.75, 1.0)
SPREAD_QUANTILES = 10  # thresholds at the deciles of the observed spreads
CUTOFF = 10


@dataclass(frozen=True, slots=True)
class ScoredQuery:
    """One query's reranked head as the server answered it, plus the BM25 tail."""

    qid: str
    ids: tuple[str, ...]  # head, in retrieval order
    ranks: tuple[int, ...]
    scores: tuple[float | None, ...]  # reranker scores; None where the pair failed
    rest: tuple[str, ...]  # the tail, in retrieval order

    def to_json(self) -> dict[str, Any]:
        return {"ids": list(self.ids), "ranks": list(self.ranks),
                "scores": list(self.scores), "rest": list(self.rest)}

    @classmethod
    def from_json(cls, qid: str, data: dict[str, Any]) -> ScoredQuery:
        """As `to_json` wrote it (the `scored` part of an `eval-NAME.json`)."""
        return cls(qid, tuple(data["ids"]), tuple(data["ranks"]), tuple(data["scores"]),
                   tuple(data["rest"]))

    def ordered(self, params: AdaptiveParams) -> list[str]:
        """Document ids in the order the server would answer with `params`."""
        finals = adaptive_scores(self.ranks, self.scores, params)
        head = sorted(range(len(self.ids)), key=lambda i: (-finals[i], self.ranks[i]))
        return [self.ids[i] for i in head] + list(self.rest)

    @property
    def spread(self) -> float:
        return spread([s for s in self.scores if s is not None])


@dataclass(frozen=True, slots=True)
class Fit:
    params: AdaptiveParams  # fitted on every query
    in_sample: float  # its mean nDCG@10 on those queries
    cross_validated: float  # mean nDCG@10 of the out-of-fold rankings
    out_of_fold: dict[str, list[str]]  # qid -> ranking under its fold's parameters
    fold_params: list[AdaptiveParams]
    grid_size: int


def ndcg(ordered: Sequence[str], judged: Mapping[str, int], k: int = CUTOFF) -> float:
    ideal = sorted((r for r in judged.values() if r > 0), reverse=True)[:k]
    idcg = sum(r / math.log2(i + 2) for i, r in enumerate(ideal))
    if idcg == 0:
        return 0.0
    dcg = sum(max(judged.get(doc, 0), 0) / math.log2(i + 2)
              for i, doc in enumerate(ordered[:k]))
    return dcg / idcg


def grid(spreads: Sequence[float]) -> list[AdaptiveParams]:
    """Candidate parameters, cautious first (see the module docstring)."""
    values = sorted(spreads) or [0.0]
    cuts = sorted({round(values[min(len(values) - 1, len(values) * q // SPREAD_QUANTILES)], 4)
                   for q in range(SPREAD_QUANTILES + 1)})
    out = []
    for high in WEIGHT_LEVELS:
        for low in WEIGHT_LEVELS:
            if low > high:
                continue
            if low == high:  # a constant weight: the thresholds do not matter
                out.append(AdaptiveParams(0.0, 0.0, low, high))
                continue
            # Higher thresholds trust the reranker less: they come first.
            out.extend(AdaptiveParams(noise, decisive, low, high)
                       for noise in reversed(cuts) for decisive in reversed(cuts)
                       if decisive >= noise)
    return out


def fit(queries: Sequence[ScoredQuery], qrels: Mapping[str, Mapping[str, int]],
        folds: int = 5, seed: int = 0) -> Fit:
    """Fit on every query, and estimate by `folds`-fold cross-validation by query."""
    if not queries:
        raise ValueError("no reranked queries to fit on")
    candidates = grid([q.spread for q in queries])
    # values[c][j]: nDCG@10 of query j under candidate c; each candidate is replayed once.
    values = [[ndcg(q.ordered(p), qrels.get(q.qid, {})) for q in queries] for p in candidates]

    def best(members: Sequence[int]) -> int:
        means = [sum(row[j] for j in members) for row in values]
        top = max(means)
        return next(c for c, m in enumerate(means) if m >= top - 1e-12)

    order = list(range(len(queries)))
    random.Random(seed).shuffle(order)
    k = max(2, min(folds, len(queries)))
    out_of_fold: dict[str, list[str]] = {}
    oof_values: list[float] = []
    fold_params: list[AdaptiveParams] = []
    for f in range(k):
        held = set(order[f::k])
        chosen = best([j for j in order if j not in held]) if len(held) < len(order) \
            else best(order)
        fold_params.append(candidates[chosen])
        for j in sorted(held):
            out_of_fold[queries[j].qid] = queries[j].ordered(candidates[chosen])
            oof_values.append(values[chosen][j])
    everything = best(order)
    return Fit(params=candidates[everything],
               in_sample=statistics.fmean(values[everything]),
               cross_validated=statistics.fmean(oof_values), out_of_fold=out_of_fold,
               fold_params=fold_params, grid_size=len(candidates))
