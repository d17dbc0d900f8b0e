"""Blend strategies: the final score from a retrieval rank and a reranker score.

Both inputs lie on 0..1. The retrieval input is `1 / rank`, not the RRF value
`1 / (60 + rank)`: RRF values sit in [0.011, 0.016], so on the reranker's 0..1 scale they
would let any mid-ranked candidate with a middling reranker score overtake rank 1 and the
weights would protect nothing. With `1 / rank` and the position-aware weights, the
retrieval rank-1 candidate scores at least 0.75 while no other can exceed 0.75
(see docs/architecture.md, "Blending").

A pair that was submitted but got no score is ordered as if the reranker agreed with
retrieval (its reranker input is taken as `1 / rank`): no invented constant, and failed
candidates keep their retrieval order relative to each other.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from .domain import BlendStrategy

POSITION_WEIGHTS = ((3, 0.75), (10, 0.60))  # (last rank of the band, retrieval weight)
TAIL_RETRIEVAL_WEIGHT = 0.40
LINEAR_RETRIEVAL_WEIGHT = 0.40
# Adaptive: spread (population standard deviation) of a request's reranker scores below
# which they count as noise, and above which they are trusted fully (docs/blending.md).
SPREAD_NOISE = 0.06
SPREAD_DECISIVE = 0.10


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
    """Final score under a fixed strategy; `None` (pair failed) is ordered as if the
    reranker agreed with retrieval. The adaptive strategy blends a whole request at once
    (`final_scores`)."""
    if strategy is BlendStrategy.ADAPTIVE:
        raise ValueError("the adaptive blend needs the whole request: use final_scores")
    r = retrieval_input(rank)
    p = r if reranker_score is None else reranker_score
    w = retrieval_weight(strategy, rank)
    return w * r + (1.0 - w) * p


def adaptive_weight(scores: Sequence[float]) -> float:
    """The reranker's weight for one request: 0 at or below `SPREAD_NOISE`, 1 at or above
    `SPREAD_DECISIVE`, linear between; monotone in the spread of `scores`."""
    if len(scores) < 2:
        return 0.0
    spread = statistics.pstdev(scores)
    return min(max((spread - SPREAD_NOISE) / (SPREAD_DECISIVE - SPREAD_NOISE), 0.0), 1.0)


def adaptive_scores(ranks: Sequence[int], scores: Sequence[float | None]) -> list[float]:
    """Final scores of one request's scored candidates under the adaptive blend.

    `w * p' + (1 - w) * 1/rank`, where p' is the reranker score min-max normalized within
    the request (so decisive scores span 0..1 like the retrieval input) and `w` is
    `adaptive_weight` of the scores present. A failed pair's p' is its 1/rank, as in the
    other blends.
    """
    present = [p for p in scores if p is not None]
    w = adaptive_weight(present)
    lo, hi = (min(present), max(present)) if present else (0.0, 0.0)
    out = []
    for rank, p in zip(ranks, scores, strict=True):
        r = retrieval_input(rank)
        normalized = r if p is None else ((p - lo) / (hi - lo) if hi > lo else r)
        out.append(w * normalized + (1.0 - w) * r)
    return out


FIXED = (BlendStrategy.POSITION_AWARE, BlendStrategy.LINEAR, BlendStrategy.RERANK_ONLY)


def final_scores(strategy: BlendStrategy, ranks: Sequence[int],
                 scores: Sequence[float | None]) -> list[float]:
    """Final scores of a request's scored candidates, for any strategy."""
    if strategy is BlendStrategy.ADAPTIVE:
        return adaptive_scores(ranks, scores)
    return [blend(strategy, r, p) for r, p in zip(ranks, scores, strict=True)]


def upper_bound(strategy: BlendStrategy, rank: int) -> float:
    """The highest final score a candidate still being scored could reach.

    Blends are monotone in the reranker score, and both a real score and the stand-in for
    a failed pair are at most 1.
    """
    return blend(strategy, rank, 1.0)
