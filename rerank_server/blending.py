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

from .domain import BlendStrategy

POSITION_WEIGHTS = ((3, 0.75), (10, 0.60))  # (last rank of the band, retrieval weight)
TAIL_RETRIEVAL_WEIGHT = 0.40
LINEAR_RETRIEVAL_WEIGHT = 0.40


def retrieval_input(rank: int) -> float:
    """The retrieval side of every blend: 1 for rank 1, 1/2 for rank 2, ..."""
    return 1.0 / rank


def retrieval_weight(strategy: BlendStrategy, rank: int) -> float:
    """The share of the final score that comes from retrieval for this rank."""
    if strategy is BlendStrategy.RERANK_ONLY:
        return 0.0
    if strategy is BlendStrategy.LINEAR:
        return LINEAR_RETRIEVAL_WEIGHT
    for last_rank, weight in POSITION_WEIGHTS:
        if rank <= last_rank:
            return weight
    return TAIL_RETRIEVAL_WEIGHT


def blend(strategy: BlendStrategy, rank: int, reranker_score: float | None) -> float:
    """Final score; `None` (pair failed) is ordered as if the reranker agreed with retrieval."""
    r = retrieval_input(rank)
    p = r if reranker_score is None else reranker_score
    w = retrieval_weight(strategy, rank)
    return w * r + (1.0 - w) * p


def upper_bound(strategy: BlendStrategy, rank: int) -> float:
    """The highest final score a candidate still being scored could reach.

    Blends are monotone in the reranker score, and both a real score and the stand-in for
    a failed pair are at most 1.
    """
    return blend(strategy, rank, 1.0)
