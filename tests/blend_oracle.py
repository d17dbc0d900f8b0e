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
