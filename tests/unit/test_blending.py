"""Blend strategies: formulas, and that the top retrieval ranks are protected."""

from __future__ import annotations

import pytest

from rerank_server.blending import blend, upper_bound
from rerank_server.domain import BlendStrategy

PA, LIN, RR = BlendStrategy.POSITION_AWARE, BlendStrategy.LINEAR, BlendStrategy.RERANK_ONLY


@pytest.mark.parametrize(("rank", "p", "expected"), [
    (1, 0.2, 0.75 * 1.0 + 0.25 * 0.2),
    (3, 0.2, 0.75 / 3 + 0.25 * 0.2),
    (4, 0.2, 0.60 / 4 + 0.40 * 0.2),
    (10, 0.9, 0.60 / 10 + 0.40 * 0.9),
    (11, 0.9, 0.40 / 11 + 0.60 * 0.9),
])
def test_position_aware_bands(rank: int, p: float, expected: float) -> None:
    assert blend(PA, rank, p) == pytest.approx(expected)


def test_linear_and_rerank_only() -> None:
    assert blend(LIN, 2, 0.5) == pytest.approx(0.4 * 0.5 + 0.6 * 0.5)
    assert blend(RR, 7, 0.33) == pytest.approx(0.33)


def test_rank_one_beats_everything_under_position_aware() -> None:
    """Rank 1 with the worst reranker score beats any other rank with the best one.

    This is the protection the RRF scale (1/(60+rank)) would have destroyed: there rank 11
    with p=0.45 beats rank 1 with p=1.0.
    """
    worst_top = blend(PA, 1, 0.0)
    assert all(blend(PA, r, 1.0) < worst_top for r in range(2, 200))


def test_top_three_hard_to_displace() -> None:
    # Rank 2 with a middling score still beats rank 11 with a clearly better one.
    assert blend(PA, 2, 0.5) > blend(PA, 11, 0.6)
    # But a decisive reranker can lift a deep candidate over a rank-3 one it rejects.
    assert blend(PA, 15, 0.95) > blend(PA, 3, 0.05)


def test_failed_pair_is_ordered_as_retrieval_agreement() -> None:
    for strategy in BlendStrategy:
        assert blend(strategy, 4, None) == pytest.approx(0.25)
        scores = [blend(strategy, r, None) for r in range(1, 30)]
        assert scores == sorted(scores, reverse=True)


def test_upper_bound_is_the_maximum() -> None:
    for strategy in BlendStrategy:
        for rank in (1, 2, 5, 12):
            bound = upper_bound(strategy, rank)
            assert all(blend(strategy, rank, p / 10) <= bound for p in range(11))
            assert blend(strategy, rank, None) <= bound
