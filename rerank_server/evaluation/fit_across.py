"""Fitting one blend profile across several collections (`rerank-server fit`): chosen by the
worst collection, each held out in turn (docs/blending.md, "Fitting").
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..ranking.blending import (
    AdaptiveParams,
)
from ..ranking.scripts import reads
from .fit import TIE, Curve, Family, Grid, Qrels, ScoredQuery, grid, ndcg

BM25 = AdaptiveParams(0.0, 0.0, 0.0, 0.0)  # the retrieval order

NEEDLE_TOP = 3  # the needle case asks for the relevant document in the top 3


@dataclass(frozen=True, slots=True)
class NeedleQuery:
    """A needle request as scored (`evaluation/needle.py`): which document is relevant."""

    query: ScoredQuery
    needle: str

    def found(self, params: AdaptiveParams, scripts: Sequence[str] = ()) -> bool:
        return self.needle in self.query.ordered(params, scripts)[:NEEDLE_TOP]


@dataclass(frozen=True, slots=True)
class Collection:
    """One data set's reranked queries and judgements, as `rerank-server eval` kept them,
    and its needle requests when the evaluation ran them (`--needle`)."""

    name: str
    queries: tuple[ScoredQuery, ...]
    qrels: Qrels
    needles: tuple[NeedleQuery, ...] = ()
    # The data set it was drawn from: one data set evaluated at two reranking depths is
    # two collections, held out together (`fit_across`). Empty: `name`.
    dataset: str = ""

    @property
    def source(self) -> str:
        return self.dataset or self.name

    def per_query(self, params: AdaptiveParams, scripts: Sequence[str] = ()) -> list[float]:
        """nDCG@10 of each query under `params`, replayed exactly."""
        return [ndcg(q.ordered(params, scripts), self.qrels.get(q.qid, {})) for q in self.queries]

    def read_needles(self, scripts: Sequence[str]) -> tuple[NeedleQuery, ...]:
        """The needle requests in a script the profile's model reads: the others it gives
        no weight, on purpose, so they are not asked of it."""
        return tuple(n for n in self.needles if reads(scripts, n.query.script))

    def needle_rate(self, params: AdaptiveParams, scripts: Sequence[str] = ()) -> float:
        """How often the needle reaches the top 3 (of the requests the model reads)."""
        cases = self.read_needles(scripts)
        return sum(n.found(params, scripts) for n in cases) / len(cases) if cases else 0.0

    def needle_reranked(self, scripts: Sequence[str] = ()) -> float:
        """The same in pure reranking's order."""
        cases = self.read_needles(scripts)
        return (
            sum(n.needle in n.query.reranked()[:NEEDLE_TOP] for n in cases) / len(cases)
            if cases
            else 0.0
        )

    def reranked(self) -> list[float]:
        """nDCG@10 of each query in pure reranking's order."""
        return [ndcg(q.reranked(), self.qrels.get(q.qid, {})) for q in self.queries]


@dataclass(frozen=True, slots=True)
class Choice:
    """Parameters chosen on some collections, and what they give on each collection."""

    params: AdaptiveParams
    fitted_on: tuple[str, ...]
    per_query: dict[str, list[float]]  # collection -> nDCG@10 per query, exact replay


@dataclass(frozen=True, slots=True)
class CrossFit:
    """A fit across collections: the profile fitted on all, and each collection held out."""

    everything: Choice  # fitted on every collection: the profile to ship
    held_out: dict[str, Choice]  # collection -> fitted on all the others
    bm25: dict[str, list[float]]
    reranker: dict[str, list[float]]  # pure reranking (`rerank_only`)
    grid_size: int
    scripts: tuple[str, ...] = ()  # what the profile's model reads
    needle_share: float = 0.0  # asked of it: of rerank_only's needle rate, per collection
    needle_met: bool = True  # whether the profile fitted on all meets it


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a choice must do beside ranking well: the needle case, on each collection
    that has needle requests its model reads, at least `share` of rerank_only's rate."""

    share: float = 0.0
    scripts: tuple[str, ...] = ()

    def met(self, params: AdaptiveParams, collections: Sequence[Collection]) -> bool:
        return all(
            c.needle_rate(params, self.scripts)
            >= self.share * c.needle_reranked(self.scripts) - TIE
            for c in collections
            if self.share and c.read_needles(self.scripts)
        )


def choose(
    collections: Sequence[Collection],
    curves: Mapping[str, Sequence[Curve]],
    best: Mapping[str, float],
    family: Family = Family.GATE,
    constraint: Constraint = Constraint(),
    tolerance: float = TIE,
) -> tuple[AdaptiveParams, int, bool]:
    """The parameters whose worst collection falls least short of its `best` (the better
    of BM25 and pure reranking there), shortfalls within `tolerance` of the least alike;
    among equals the best mean over collections; then the most cautious; the first in
    that order that meets `constraint` (the first of all when none does). Returns them,
    the grid's size and whether they meet it."""
    candidates = Grid(
        grid(
            [c.spread for x in collections for c in curves[x.name]],
            [c.top for x in collections for c in curves[x.name]],
            family,
        )
    )
    means = np.stack([candidates.values(curves[x.name]).mean(axis=1) for x in collections], axis=1)
    targets = np.array([best[x.name] for x in collections])
    worst = (targets[None, :] - means).max(axis=1)
    least = worst <= worst.min() + max(tolerance, TIE)
    # Worst shortfall first (the least ones alike), then the best mean, then cautious.
    order = np.lexsort(
        (np.arange(len(candidates)), -means.mean(axis=1), np.where(least, worst.min(), worst))
    )
    for i in order:
        if constraint.met(candidates.params[i], collections):
            return candidates.params[i], len(candidates), True
    return candidates.params[order[0]], len(candidates), False


def fit_across(
    collections: Sequence[Collection],
    family: Family = Family.GATE,
    constraint: Constraint = Constraint(),
    tolerance: float = TIE,
) -> CrossFit:
    """Fit on every collection, and on every collection but one for each one; a profile
    whose model reads `constraint.scripts` gives other requests no weight."""
    if not collections or not all(c.queries for c in collections):
        raise ValueError("every collection needs reranked queries")
    scripts = constraint.scripts
    curves = {
        c.name: [Curve(q, c.qrels.get(q.qid, {}), reads(scripts, q.script)) for q in c.queries]
        for c in collections
    }
    bm25 = {c.name: c.per_query(BM25) for c in collections}
    reranker = {c.name: c.reranked() for c in collections}
    best = {
        c.name: max(statistics.fmean(bm25[c.name]), statistics.fmean(reranker[c.name]))
        for c in collections
    }

    def chosen(on: Sequence[Collection]) -> tuple[Choice, int]:
        params, size, _ = choose(on, curves, best, family, constraint, tolerance)
        return Choice(
            params,
            tuple(c.name for c in on),
            {c.name: c.per_query(params, scripts) for c in collections},
        ), size

    everything, size = chosen(collections)
    # Held out with the other depths of its data set: the profile on data nobody fitted.
    held_out = {
        c.name: chosen([o for o in collections if o.source != c.source])[0]
        for c in collections
        if len({o.source for o in collections}) > 1
    }
    return CrossFit(
        everything,
        held_out,
        bm25,
        reranker,
        size,
        scripts,
        constraint.share,
        constraint.met(everything.params, collections),
    )
