"""Blend strategies: the final score from a retrieval rank and a reranker score.

Why `1 / rank` and what each strategy protects: docs/architecture.md, "Blending".
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..domain import BlendStrategy

POSITION_WEIGHTS = ((3, 0.75), (10, 0.60))  # (last rank of the band, retrieval weight)
TAIL_RETRIEVAL_WEIGHT = 0.40
LINEAR_RETRIEVAL_WEIGHT = 0.40


@dataclass(frozen=True, slots=True)
class AdaptiveParams:
    """The request-wide blend's parameters.

    The reranker's weight rises from `min_weight` at a score spread (the population
    standard deviation as it would be at 20 candidates: `evidence`) of `spread_noise` or
    less to `max_weight` at `spread_decisive` or more; all
    of it is then scaled by a gate on the request's best score, 0 at `top_floor` or below
    and 1 at `top_full` or above. The gate is what an absolute score adds to the spread: a
    scorer reading text it does not understand (an English model on Arabic) can spread its
    scores widely, but its best score stays below what it gives a real match. With both
    at 0 (the built-in values) there is no gate. A fitted blend profile is a set of these
    for one backend and model (`blend_profiles.py`)."""

    # The built-in `adaptive` values, read off per-request spreads (docs/blending.md).
    spread_noise: float = 0.06
    spread_decisive: float = 0.10
    min_weight: float = 0.0
    max_weight: float = 1.0
    top_floor: float = 0.0
    top_full: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_weight <= self.max_weight <= 1.0:
            raise ValueError("weights must satisfy 0 <= min_weight <= max_weight <= 1")
        if not 0.0 <= self.spread_noise <= self.spread_decisive:
            raise ValueError("spreads must satisfy 0 <= spread_noise <= spread_decisive")
        if not 0.0 <= self.top_floor <= self.top_full <= 1.0:
            raise ValueError("the gate must satisfy 0 <= top_floor <= top_full <= 1")

    def weight(self, spread: float, top: float = 1.0) -> float:
        """The reranker's weight at this spread and best score; monotone non-decreasing
        in both."""
        by_spread = self.min_weight + ramp(spread, self.spread_noise, self.spread_decisive) * (
            self.max_weight - self.min_weight
        )
        return by_spread * ramp(top, self.top_floor, self.top_full)


def ramp(x: float, low: float, high: float) -> float:
    """0 at `low` or below, 1 at `high` or above, linear between (a step when equal)."""
    if x >= high:
        return 1.0
    if x <= low:
        return 0.0
    return (x - low) / (high - low)


ADAPTIVE = AdaptiveParams()
NO_WEIGHT = AdaptiveParams(0.0, 0.0, 0.0, 0.0)  # the retrieval order, whatever the scores
# Strategies whose weight and scale depend on every score of the request (`Settled`).
REQUEST_WIDE = frozenset({BlendStrategy.ADAPTIVE, BlendStrategy.PROFILE})


def retrieval_input(rank: int) -> float:
    """The retrieval side of every blend: 1 for rank 1, 1/2 for rank 2, ..."""
    return 1.0 / rank


def retrieval_weight(strategy: BlendStrategy, rank: int) -> float:
    """The share of the final score that comes from retrieval for this rank (the fixed
    blends; the adaptive one decides per request in `adaptive_scores`)."""
    if strategy is BlendStrategy.RERANK_ONLY:
        return 0.0
    if strategy is BlendStrategy.LINEAR:
        return LINEAR_RETRIEVAL_WEIGHT
    for last_rank, weight in POSITION_WEIGHTS:
        if rank <= last_rank:
            return weight
    return TAIL_RETRIEVAL_WEIGHT


def blend(strategy: BlendStrategy, rank: int, reranker_score: float | None) -> float:
    """Final score under a fixed strategy. `None` (pair failed) is ordered as if the
    reranker agreed with retrieval, except under `rerank_only`, which orders by the
    reranker's scores alone: there a failed pair scores 0 and follows every scored one,
    in retrieval order (`ordering`), as a pair beyond the cap does. The request-wide
    strategies blend a whole request at once (`adaptive_blend`)."""
    if strategy in REQUEST_WIDE:
        raise ValueError(f"the {strategy} blend needs the whole request: use adaptive_blend")
    r = retrieval_input(rank)
    if reranker_score is not None:
        p = reranker_score
    else:
        p = 0.0 if strategy is BlendStrategy.RERANK_ONLY else r
    w = retrieval_weight(strategy, rank)
    return w * r + (1.0 - w) * p


def spread(scores: Sequence[float]) -> float:
    """The evidence the adaptive blend weighs: the population standard deviation, in
    floats with compensated sums (`statistics.pstdev`'s exact arithmetic costs 17x)."""
    n = len(scores)
    if n < 2:
        return 0.0
    mean = math.fsum(scores) / n
    return math.sqrt(math.fsum((s - mean) ** 2 for s in scores) / n)


# The list length the spread thresholds are read at: blend profiles are fitted on 20
# candidates, and `evidence` gives a longer list the spread it would have there.
REFERENCE_DEPTH = 20


def evidence(scores: Sequence[float]) -> float:
    """How clearly the model tells this request's candidates apart: the spread of
    `scores` as it would be at `REFERENCE_DEPTH` candidates, the best one among them.

    Up to that depth it is the spread itself. Past it, it is the population standard
    deviation of the best score with `REFERENCE_DEPTH - 1` others distributed as the rest
    (their mean `m`, variance `v`), `sqrt((R-1)/R * v + (R-1)/R**2 * (best - m)**2)`:
    at R candidates exactly the spread. One clear favourite among many equal scores
    spreads a long list by about 1/sqrt(n) of its lead, which would fall under any fixed
    threshold at some length; here its evidence is the same at 20 candidates or 1,000,
    while noise gains little (its best over its mean grows like sqrt(2 ln n): 12% more
    evidence at 100 candidates than at 20, 21% at 1,000)."""
    n = len(scores)
    if n <= REFERENCE_DEPTH:
        return spread(scores)
    best = max(scores)
    total = math.fsum(scores)
    rest_mean = (total - best) / (n - 1)
    # The rest's variance, the best taken out once (ties leave the others in).
    squares = math.fsum((s - rest_mean) ** 2 for s in scores) - (best - rest_mean) ** 2
    rest_var = max(squares, 0.0) / (n - 1)
    r = REFERENCE_DEPTH
    return math.sqrt((r - 1) / r * rest_var + (r - 1) / r**2 * (best - rest_mean) ** 2)


def adaptive_weight(scores: Sequence[float], params: AdaptiveParams = ADAPTIVE) -> float:
    """The reranker's weight for one request, from the `evidence` and the best of its
    `scores`; with the defaults 0 at or below an evidence of 0.06, 1 at or above 0.10,
    linear between. Fewer than two scores carry no evidence: the weight is `min_weight`
    (still gated by the best score)."""
    if len(scores) < 2:
        return params.min_weight * ramp(max(scores, default=0.0), params.top_floor, params.top_full)
    return params.weight(evidence(scores), max(scores))


_FLAT = 1e-12  # a normalization range no wider than this is no range (`Settled`)


@dataclass(frozen=True, slots=True)
class Settled:
    """A request-wide blend, settled on every score of the request.

    `w * n + (1 - w) * 1/rank`, where `w` is `adaptive_weight` of the request's scores
    and n a score min-max normalized on their range (so the best score is 1 and the worst
    0, whatever the scorer's scale: P(yes), cosine, a grade / 10). A failed pair's n is
    its 1/rank, as in the other blends. Every scored candidate counts alike wherever
    retrieval put it: a document at rank 15 that the model prefers clearly enough weighs
    in the spread and tops the scale like one at rank 1.
    """

    weight: float
    low: float
    high: float

    @classmethod
    def on(cls, scores: Sequence[float], params: AdaptiveParams = ADAPTIVE) -> Settled:
        return cls.weighted(adaptive_weight(scores, params), scores)

    @classmethod
    def weighted(cls, weight: float, scores: Sequence[float]) -> Settled:
        low, high = (min(scores), max(scores)) if scores else (0.0, 0.0)
        return cls(weight, low, high)

    def normalized(self, rank: int, score: float | None) -> float:
        # A range too narrow to tell scores apart (equal scores, or equal but for
        # rounding) normalizes nothing: every candidate keeps its retrieval input.
        if score is None or self.high - self.low <= _FLAT:
            return retrieval_input(rank)
        return min(1.0, max(0.0, (score - self.low) / (self.high - self.low)))

    def final(self, rank: int, score: float | None) -> float:
        return self.finals(((rank, score),))[0]

    def upper_bound(self, rank: int) -> float:
        """The highest final score a candidate still being scored could reach."""
        return self.weight + (1.0 - self.weight) * retrieval_input(rank)

    def finals(self, ranked: Iterable[tuple[int, float | None]]) -> list[float]:
        """`final` of each (rank, score): `normalized` and the blend inline, one loop for
        a whole request's scores (the clip as comparisons, `retrieval_input` as
        `1.0 / rank`), which is what the pipeline's hot loop calls."""
        weight, low, span = self.weight, self.low, self.high - self.low
        keep = 1.0 - weight
        flat = span <= _FLAT
        out = []
        for rank, score in ranked:
            r = 1.0 / rank
            if score is None or flat:
                n = r
            else:
                n = (score - low) / span
                if n > 1.0:
                    n = 1.0
                elif n < 0.0:
                    n = 0.0
            out.append(weight * n + keep * r)
        return out


def adaptive_scores(
    ranks: Sequence[int], scores: Sequence[float | None], params: AdaptiveParams = ADAPTIVE
) -> list[float]:
    """Final scores of one request's scored candidates under the adaptive blend."""
    return adaptive_blend(ranks, scores, params)[0]


def adaptive_blend(
    ranks: Sequence[int], scores: Sequence[float | None], params: AdaptiveParams = ADAPTIVE
) -> tuple[list[float], float]:
    """Final scores under the request-wide blend (`Settled`), and the reranker's weight."""
    settled = Settled.on([p for p in scores if p is not None], params)
    return settled.finals(zip(ranks, scores, strict=True)), settled.weight


def scores_can_matter(
    strategy: BlendStrategy, params: AdaptiveParams, ranks: Sequence[int], top_k: int
) -> bool:
    """Whether any reranker score could change the answer's first `top_k` places (all
    when 0). Not when a request-wide blend can give the reranker no weight (`max_weight`
    0), nor when a fixed blend's worst case for each of those places still beats the
    best case of every candidate after it (position_aware's rank 1 with `top_k` 1)."""
    if strategy in REQUEST_WIDE:
        return params.max_weight > 0.0
    ordered = sorted(ranks)
    if not top_k or top_k >= len(ordered):
        return True
    # A failed pair stands in at or above the worst score of 0 (at it under rerank_only).
    return not all(
        blend(strategy, ordered[i], 0.0) >= blend(strategy, ordered[i + 1], 1.0)
        for i in range(top_k)
    )


def upper_bound(strategy: BlendStrategy, rank: int) -> float:
    """The highest final score a candidate still being scored could reach.

    Blends are monotone in the reranker score, and both a real score and the stand-in for
    a failed pair are at most 1.
    """
    return blend(strategy, rank, 1.0)
