"""Fitting a blend profile: the request-wide blend's parameters for one scorer.

How a fit chooses: docs/blending.md, "Fitting"; how it is fast: `Curve`.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import math
import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ..domain import BlendStrategy
from ..ranking.blending import (
    ADAPTIVE,
    NO_WEIGHT,
    AdaptiveParams,
    Settled,
    adaptive_scores,
    blend,
    evidence,
    retrieval_input,
)
from ..ranking.scripts import reads

WEIGHT_LEVELS = (0.0, 0.25, 0.5, 0.75, 1.0)


QUANTILES = 10  # thresholds at the deciles of the observed spreads and best scores


CUTOFF = 10


TIE = 1e-9


Floats = npt.NDArray[np.float64]


Qrels = Mapping[str, Mapping[str, int]]


@dataclass(frozen=True, slots=True)
class ScoredQuery:
    """One query's reranked head as the server answered it, plus the BM25 tail."""

    qid: str
    ids: tuple[str, ...]  # head, in retrieval order
    ranks: tuple[int, ...]
    scores: tuple[float | None, ...]  # reranker scores; None where the pair failed
    rest: tuple[str, ...]  # the tail, in retrieval order
    script: str = ""  # the request's writing system (`ranking.scripts`)

    def to_json(self) -> dict[str, Any]:
        return {
            "ids": list(self.ids),
            "ranks": list(self.ranks),
            "scores": list(self.scores),
            "rest": list(self.rest),
            "script": self.script,
        }

    @classmethod
    def from_json(cls, qid: str, data: dict[str, Any]) -> ScoredQuery:
        """As `to_json` wrote it (the `scored` part of an `eval-NAME.json`)."""
        return cls(
            qid,
            tuple(data["ids"]),
            tuple(data["ranks"]),
            tuple(data["scores"]),
            tuple(data.get("rest", ())),
            str(data.get("script", "")),
        )

    def ordered(self, params: AdaptiveParams, scripts: Sequence[str] = ()) -> list[str]:
        """Document ids in the order the server would answer with `params`, from a
        profile whose model reads `scripts` (no weight for a request in another)."""
        if not reads(scripts, self.script):
            params = NO_WEIGHT
        return self._order(adaptive_scores(self.ranks, self.scores, params))

    def reranked(self) -> list[str]:
        """Document ids in pure reranking's order (`rerank_only`: the raw scores)."""
        return self._order(
            [
                blend(BlendStrategy.RERANK_ONLY, r, p)
                for r, p in zip(self.ranks, self.scores, strict=True)
            ]
        )

    def _order(self, finals: Sequence[float]) -> list[str]:
        head = sorted(range(len(self.ids)), key=lambda i: (-finals[i], self.ranks[i]))
        return [self.ids[i] for i in head] + list(self.rest)

    @property
    def present(self) -> list[float]:
        return [s for s in self.scores if s is not None]

    @property
    def spread(self) -> float:
        return evidence(self.present)

    @property
    def top(self) -> float:
        return max(self.present, default=0.0)


def ndcg(ordered: Sequence[str], judged: Mapping[str, int], k: int = CUTOFF) -> float:
    ideal = sorted((r for r in judged.values() if r > 0), reverse=True)[:k]
    idcg = sum(r / math.log2(i + 2) for i, r in enumerate(ideal))
    if idcg == 0:
        return 0.0
    dcg = sum(max(judged.get(doc, 0), 0) / math.log2(i + 2) for i, doc in enumerate(ordered[:k]))
    return dcg / idcg


class Curve:
    """One query's nDCG@10 as a function of the reranker's weight `w` in 0..1; an
    untrusted one (a script the profile's model does not read) gets weight 0 from every
    candidate.

    The normalization is fixed by the request's scores (`blending.Settled`), so each
    candidate's final score is linear in `w` and nDCG@10 is a step function of it, its
    steps where two candidates' lines cross. They are computed once; a parameter set's
    value on the query is then a lookup at the weight it gives it, so a grid of tens of
    thousands is scored in seconds. What a fit reports is replayed exactly through
    `ScoredQuery.ordered` (`blending.adaptive_scores`, what the server blends with).
    """

    def __init__(self, query: ScoredQuery, judged: Mapping[str, int], trusted: bool = True) -> None:
        present = query.present
        # Fewer than two scores: the weight is min_weight (`adaptive_weight`); a spread
        # below every threshold gives that. Untrusted: a best score below every gate too.
        self.spread = evidence(present) if len(present) >= 2 and trusted else -1.0
        self.top = max(present, default=0.0) if trusted else -1.0
        # final_i(w) = r_i + w * (n_i - r_i): n is the normalized score, r = 1/rank
        # (`blending.Settled`; the weight does not change n).
        settled = Settled.on(present)
        r = [retrieval_input(k) for k in query.ranks]
        n = [settled.normalized(k, p) for k, p in zip(query.ranks, query.scores, strict=True)]
        slope = [a - b for a, b in zip(n, r, strict=True)]
        crossings = {
            (r[j] - r[i]) / (slope[i] - slope[j])
            for i, j in itertools.combinations(range(len(r)), 2)
            if slope[i] != slope[j]
        }
        self.steps: Floats = np.array(sorted(w for w in crossings if 0.0 < w < 1.0))

        def value(w: float) -> float:
            # The very arithmetic of `Settled.final`, so that ties at a step fall the
            # same way as in the server.
            return ndcg(
                query._order([w * b + (1.0 - w) * a for a, b in zip(r, n, strict=True)]), judged
            )

        edges = [0.0, *self.steps.tolist(), 1.0]
        self.between: Floats = np.array([value((a + b) / 2) for a, b in itertools.pairwise(edges)])
        self.at_steps: Floats = np.array([value(w) for w in self.steps.tolist()])
        self.at_zero, self.at_one = value(0.0), value(1.0)

    def at(self, weights: Floats) -> Floats:
        """nDCG@10 at each weight."""
        i = np.searchsorted(self.steps, weights)  # steps[i-1] < w <= steps[i]
        out = self.between[i]
        if len(self.steps):
            j = np.minimum(i, len(self.steps) - 1)
            out = np.where(self.steps[j] == weights, self.at_steps[j], out)
        out = np.where(weights <= 0.0, self.at_zero, out)
        return np.where(weights >= 1.0, self.at_one, out)


def _ramp(x: float, low: Floats, high: Floats) -> Floats:
    """`blending.ramp` over arrays of thresholds."""
    width = np.where(high > low, high - low, 1.0)
    return np.where(x >= high, 1.0, np.where(x <= low, 0.0, (x - low) / width))


class Grid:
    """Candidate parameter sets as columns of arrays, cautious first (`grid`)."""

    def __init__(self, candidates: Sequence[AdaptiveParams]) -> None:
        self.params = list(candidates)
        a = np.array(
            [
                [
                    p.spread_noise,
                    p.spread_decisive,
                    p.min_weight,
                    p.max_weight,
                    p.top_floor,
                    p.top_full,
                ]
                for p in self.params
            ]
        ).reshape(-1, 6)
        self._noise, self._decisive, self._low, self._high, self._floor, self._full = a.T

    def __len__(self) -> int:
        return len(self.params)

    def weights(self, curve: Curve) -> Floats:
        """The weight each candidate gives this query (`AdaptiveParams.weight`)."""
        by_spread = self._low + _ramp(curve.spread, self._noise, self._decisive) * (
            self._high - self._low
        )
        return np.asarray(by_spread * _ramp(curve.top, self._floor, self._full))

    def values(self, curves: Sequence[Curve]) -> Floats:
        """values[c, j]: nDCG@10 of query j under candidate c."""
        return (
            np.stack([c.at(self.weights(c)) for c in curves], axis=1)
            if curves
            else np.zeros((len(self), 0))
        )


def _cuts(values: Sequence[float]) -> list[float]:
    # (-1 marks no evidence: fewer than two scores, or a request its model does not read.)
    ordered = sorted(v for v in values if v >= 0.0) or [0.0]
    return sorted(
        {
            round(ordered[min(len(ordered) - 1, len(ordered) * q // QUANTILES)], 4)
            for q in range(QUANTILES + 1)
        }
    )


class Family(enum.StrEnum):
    """Which parameters a fit may choose (docs/blending.md compares them)."""

    # The built-in spread ramp (weight 0 up to a spread of 0.06, 1 from 0.10) with a fitted
    # best-score gate; or the retrieval order. Few parameters: it carries over best to
    # collections nobody fitted on (the worst held-out result of the families).
    GATE = "gate"
    # Spread thresholds, weights on a quarter grid and the gate, all fitted.
    FULL = "full"
    # Spread thresholds alone (weight 0 below the one, 1 above the other), no gate: for
    # a profile whose distrust is in its `scripts`, not in a best-score gate.
    RAMP = "ramp"


def grid(
    spreads: Sequence[float], tops: Sequence[float] = (), family: Family = Family.GATE
) -> list[AdaptiveParams]:
    """Candidate parameters, cautious first: spread thresholds at the deciles of the
    fitting data's per-request spreads, best-score gates at the deciles of its best
    scores (both follow each model's scale), reranker weights on `WEIGHT_LEVELS`. Ties go
    to the first entry, and low weights and high thresholds come first: a scorer with no
    signal is fitted to the retrieval order."""
    spread_cuts, top_cuts = _cuts(spreads), _cuts(tops) if tops else []
    # Higher thresholds trust the reranker less: they come first. (0, 0): no gate.
    gates = [(f, g) for f in reversed(top_cuts) for g in reversed(top_cuts) if g >= f]
    gates.append((0.0, 0.0))
    out = [AdaptiveParams(0.0, 0.0, 0.0, 0.0)]  # the retrieval order
    if family is Family.RAMP:
        out.extend(
            AdaptiveParams(noise, decisive)
            for noise in reversed(spread_cuts)
            for decisive in reversed(spread_cuts)
            if decisive >= noise
        )
        return out
    if family is Family.GATE:
        out.extend(
            dataclasses.replace(ADAPTIVE, top_floor=floor, top_full=full) for floor, full in gates
        )
        return out
    for high in WEIGHT_LEVELS[1:]:
        for low in WEIGHT_LEVELS:
            if low > high:
                continue
            spreads_ = (
                [(0.0, 0.0)]
                if low == high
                else [
                    (noise, decisive)
                    for noise in reversed(spread_cuts)
                    for decisive in reversed(spread_cuts)
                    if decisive >= noise
                ]
            )
            out.extend(
                AdaptiveParams(noise, decisive, low, high, floor, full)
                for noise, decisive in spreads_
                for floor, full in gates
            )
    return out


def _first_best(means: Floats) -> int:
    return int(np.flatnonzero(means >= means.max() - TIE)[0])


@dataclass(frozen=True, slots=True)
class Fit:
    """A fit on one data set: the parameters, and their in-sample and cross-validated score."""

    params: AdaptiveParams  # fitted on every query
    in_sample: float  # its mean nDCG@10 on those queries
    cross_validated: float  # mean nDCG@10 of the out-of-fold rankings
    out_of_fold: dict[str, list[str]]  # qid -> ranking under its fold's parameters
    fold_params: list[AdaptiveParams]
    grid_size: int


def fit(
    queries: Sequence[ScoredQuery],
    qrels: Qrels,
    folds: int = 5,
    seed: int = 0,
    family: Family = Family.GATE,
) -> Fit:
    """Fit on every query, and estimate by `folds`-fold cross-validation by query."""
    if not queries:
        raise ValueError("no reranked queries to fit on")
    candidates = Grid(grid([q.spread for q in queries], [q.top for q in queries], family))
    values = candidates.values([Curve(q, qrels.get(q.qid, {})) for q in queries])
    order = list(range(len(queries)))
    random.Random(seed).shuffle(order)
    k = max(2, min(folds, len(queries)))
    out_of_fold: dict[str, list[str]] = {}
    oof_values: list[float] = []
    fold_params: list[AdaptiveParams] = []
    for f in range(k):
        held = set(order[f::k])
        train = [j for j in order if j not in held] or order
        chosen = candidates.params[_first_best(values[:, train].sum(axis=1))]
        fold_params.append(chosen)
        for j in sorted(held):
            out_of_fold[queries[j].qid] = queries[j].ordered(chosen)
            oof_values.append(ndcg(out_of_fold[queries[j].qid], qrels.get(queries[j].qid, {})))
    everything = candidates.params[_first_best(values.sum(axis=1))]
    return Fit(
        params=everything,
        in_sample=statistics.fmean(
            ndcg(q.ordered(everything), qrels.get(q.qid, {})) for q in queries
        ),
        cross_validated=statistics.fmean(oof_values),
        out_of_fold=out_of_fold,
        fold_params=fold_params,
        grid_size=len(candidates),
    )
