"""The final scores a request should get, computed the plain way: every score at once.

The server blends incrementally (`IncrementalRanking`); tests compare its output with this.
"""

from __future__ import annotations

from collections.abc import Sequence

from rerank_server.domain import BlendStrategy
from rerank_server.ranking.blending import (
    ADAPTIVE,
    REQUEST_WIDE,
    AdaptiveParams,
    adaptive_scores,
    blend,
)


def final_scores(
    strategy: BlendStrategy,
    ranks: Sequence[int],
    scores: Sequence[float | None],
    params: AdaptiveParams = ADAPTIVE,
) -> list[float]:
    """Final scores of a request's scored candidates; `params` are the request-wide blend's."""
    if strategy in REQUEST_WIDE:
        return adaptive_scores(ranks, scores, params)
    return [blend(strategy, r, p) for r, p in zip(ranks, scores, strict=True)]


def order_key(
    strategy: BlendStrategy, rank: int, index: int, final: float, score: float | None
) -> tuple[bool, float, int, int]:
    """Where a scored-set candidate belongs in the final order: by final score, then
    retrieval rank and position; under `rerank_only` a pair the model did not score
    follows every scored one."""
    return (strategy is BlendStrategy.RERANK_ONLY and score is None, -final, rank, index)
