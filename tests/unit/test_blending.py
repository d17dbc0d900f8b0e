"""Blend strategies: formulas, and that the top retrieval ranks are protected."""

from __future__ import annotations

import random
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rerank_server.domain import BlendStrategy
from rerank_server.ranking import blend_profiles
from rerank_server.ranking.blending import (
    ADAPTIVE,
    REFERENCE_DEPTH,
    REQUEST_WIDE,
    AdaptiveParams,
    Settled,
    adaptive_scores,
    adaptive_weight,
    blend,
    evidence,
    retrieval_input,
    scores_can_matter,
    spread,
    upper_bound,
)

FIXED_BLENDS = [s for s in BlendStrategy if s not in REQUEST_WIDE]  # per candidate

PA, LIN, RR = BlendStrategy.POSITION_AWARE, BlendStrategy.LINEAR, BlendStrategy.RERANK_ONLY


@pytest.mark.parametrize(
    ("rank", "p", "expected"),
    [
        (1, 0.2, 0.75 * 1.0 + 0.25 * 0.2),
        (3, 0.2, 0.75 / 3 + 0.25 * 0.2),
        (4, 0.2, 0.60 / 4 + 0.40 * 0.2),
        (10, 0.9, 0.60 / 10 + 0.40 * 0.9),
        (11, 0.9, 0.40 / 11 + 0.60 * 0.9),
    ],
)
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
    for strategy in (PA, LIN):
        assert blend(strategy, 4, None) == pytest.approx(0.25)
        scores = [blend(strategy, r, None) for r in range(1, 30)]
        assert scores == sorted(scores, reverse=True)


def test_under_rerank_only_a_failed_pair_follows_every_scored_one() -> None:
    """The reranker's order alone: a failed retrieval rank 1 has no score to stand on."""
    assert blend(RR, 1, None) == 0.0 < blend(RR, 30, 0.01)
    # Failed pairs among themselves, and ties with a score of 0, go by retrieval rank.
    ranked = sorted(
        [(1, None), (2, 0.3), (3, None), (4, 0.0), (5, 0.9)],
        key=lambda rp: (-blend(RR, rp[0], rp[1]), rp[0]),
    )
    assert [r for r, _ in ranked] == [5, 2, 1, 3, 4]


def test_upper_bound_is_the_maximum() -> None:
    for strategy in FIXED_BLENDS:
        for rank in (1, 2, 5, 12):
            bound = upper_bound(strategy, rank)
            assert all(blend(strategy, rank, p / 10) <= bound for p in range(11))
            assert blend(strategy, rank, None) <= bound


# --- the adaptive blend (docs/blending.md)


def _order(
    ranks: list[int], scores: list[float | None], params: AdaptiveParams = ADAPTIVE
) -> list[int]:
    finals = adaptive_scores(ranks, scores, params)
    return sorted(ranks, key=lambda r: (-finals[ranks.index(r)], r))


def test_adaptive_keeps_retrieval_order_when_scores_are_constant() -> None:
    ranks = list(range(1, 11))
    assert adaptive_weight([0.53] * 10) == 0.0
    assert _order(ranks, [0.53] * 10) == ranks


def test_adaptive_follows_the_reranker_when_scores_are_decisive() -> None:
    ranks = list(range(1, 7))
    scores: list[float | None] = [0.1, 0.9, 0.3, 0.8, 0.2, 0.7]
    assert adaptive_weight([s for s in scores if s is not None]) == 1.0
    assert _order(ranks, scores) == [2, 4, 6, 3, 5, 1]


def test_adaptive_ignores_compressed_noise() -> None:
    """Scores like the weak stand-in's (0.50..0.56, spread 0.02) leave retrieval alone."""
    ranks = list(range(1, 9))
    noise: list[float | None] = [0.51, 0.56, 0.50, 0.55, 0.52, 0.53, 0.50, 0.55]
    assert adaptive_weight([s for s in noise if s is not None]) == 0.0
    assert _order(ranks, noise) == ranks


@given(st.lists(st.floats(0, 1), min_size=2, max_size=30), st.floats(1.0, 5.0))
def test_adaptive_weight_is_monotone_in_the_spread(scores: list[float], stretch: float) -> None:
    mean = sum(scores) / len(scores)
    wider = [mean + (s - mean) * stretch for s in scores]
    assert adaptive_weight(wider) >= adaptive_weight(scores) - 1e-12


@given(st.lists(st.floats(0.0, 0.5), min_size=2, max_size=20), st.floats(0.0, 0.5))
def test_adaptive_order_does_not_depend_on_the_scores_offset(
    scores: list[float], shift: float
) -> None:
    ranks = list(range(1, len(scores) + 1))
    base: list[float | None] = list(scores)
    shifted: list[float | None] = [s + shift for s in scores]
    assert adaptive_weight(scores) == pytest.approx(adaptive_weight([s + shift for s in scores]))
    a, b = adaptive_scores(ranks, base), adaptive_scores(ranks, shifted)
    assert a == pytest.approx(b, abs=1e-9)


def test_adaptive_failed_pairs_keep_their_retrieval_place_relative_to_each_other() -> None:
    finals = adaptive_scores([1, 2, 3, 4], [None, 0.9, None, 0.1])
    assert finals[0] > finals[2]  # both failed: rank 1 stays ahead of rank 3


def test_request_wide_blends_have_no_per_candidate_blend() -> None:
    for strategy in (BlendStrategy.ADAPTIVE, BlendStrategy.PROFILE):
        with pytest.raises(ValueError):
            blend(strategy, 1, 0.5)


params = st.builds(
    lambda noise, width, low, extra: AdaptiveParams(
        noise, noise + width, low, min(1.0, low + extra)
    ),
    st.floats(0, 0.3),
    st.floats(0, 0.3),
    st.floats(0, 1),
    st.floats(0, 1),
)


@given(params, st.floats(0, 1), st.floats(0, 1))
def test_profile_weight_is_monotone_and_within_its_bounds(
    p: AdaptiveParams, a: float, b: float
) -> None:
    low, high = sorted((a, b))
    assert p.min_weight <= p.weight(low) <= p.weight(high) <= p.max_weight
    assert p.weight(p.spread_noise if p.spread_noise < p.spread_decisive else -1) == p.min_weight
    assert p.weight(p.spread_decisive) == p.max_weight


@given(
    params, st.floats(0, 0.5), st.floats(0, 0.5), st.floats(0, 1), st.floats(0, 1), st.floats(0, 1)
)
def test_the_best_score_gate_only_ever_lowers_the_weight_and_is_monotone(
    p: AdaptiveParams, floor: float, width: float, a: float, b: float, spread_: float
) -> None:
    gated = AdaptiveParams(
        p.spread_noise,
        p.spread_decisive,
        p.min_weight,
        p.max_weight,
        floor,
        min(1.0, floor + width),
    )
    low, high = sorted((a, b))
    assert 0.0 <= gated.weight(spread_, low) <= gated.weight(spread_, high) <= p.weight(spread_)
    assert gated.weight(spread_, floor) == (p.weight(spread_) if gated.top_full == floor else 0.0)
    assert gated.weight(spread_, gated.top_full) == p.weight(spread_)


def test_a_request_whose_best_score_is_low_keeps_the_retrieval_order() -> None:
    """Widely spread but low scores (an English model reading Arabic): the spread alone
    trusts them fully, the gate not at all."""
    scores: list[float] = [0.05, 0.40, 0.10, 0.35]
    gate = AdaptiveParams(0.06, 0.10, 0.0, 1.0, top_floor=0.6, top_full=0.8)
    assert adaptive_weight(scores) == 1.0 and adaptive_weight(scores, gate) == 0.0
    assert _order([1, 2, 3, 4], scores, gate) == [1, 2, 3, 4]
    assert adaptive_weight([0.05, 0.70, 0.10, 0.65], gate) == pytest.approx(0.5)


def test_the_built_in_adaptive_blend_is_the_default_profile() -> None:
    scores: list[float | None] = [0.9, 0.2, 0.6, 0.1]
    assert adaptive_scores([1, 2, 3, 4], scores) == adaptive_scores(
        [1, 2, 3, 4], scores, AdaptiveParams(0.06, 0.10, 0.0, 1.0)
    )


def test_a_constant_weight_profile_ignores_the_spread() -> None:
    half = AdaptiveParams(0.0, 0.0, 0.5, 0.5)
    assert adaptive_weight([0.5, 0.5001], half) == adaptive_weight([0.0, 1.0], half) == 0.5
    # Weight 0 is the retrieval order, whatever the reranker says.
    never = AdaptiveParams(0.0, 0.0, 0.0, 0.0)
    assert _order([1, 2, 3], [0.0, 0.5, 1.0], never) == [1, 2, 3]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_weight": 0.6, "max_weight": 0.5}, "min_weight <= max_weight"),
        ({"max_weight": 1.5}, "max_weight <= 1"),
        ({"spread_noise": 0.2, "spread_decisive": 0.1}, "spread_noise <= spread_decisive"),
    ],
)
def test_profile_parameters_are_checked(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AdaptiveParams(**kwargs)


def test_scores_cannot_matter_when_no_weight_or_no_score_can_move_the_top_k() -> None:
    ranks = list(range(1, 21))
    never = AdaptiveParams(0.0, 0.0, 0.0, 0.0)
    assert not scores_can_matter(BlendStrategy.PROFILE, never, ranks, 0)
    assert scores_can_matter(BlendStrategy.ADAPTIVE, ADAPTIVE, ranks, 0)
    # position_aware: rank 1 scores at least 0.75, no other more than 0.625 (rank 2).
    assert not scores_can_matter(BlendStrategy.POSITION_AWARE, ADAPTIVE, ranks, 1)
    assert scores_can_matter(BlendStrategy.POSITION_AWARE, ADAPTIVE, ranks, 2)
    assert scores_can_matter(BlendStrategy.POSITION_AWARE, ADAPTIVE, ranks, 0)
    assert scores_can_matter(BlendStrategy.RERANK_ONLY, ADAPTIVE, ranks, 1)
    # The claim holds for every score the pairs could get.
    rng = random.Random(5)
    for _ in range(200):
        scores = [rng.random() for _ in ranks]
        finals = [blend(PA, r, p) for r, p in zip(ranks, scores, strict=True)]
        assert max(range(20), key=lambda i: (finals[i], -ranks[i])) == 0


@given(st.lists(st.floats(min_value=-1.0, max_value=1.0), min_size=0, max_size=120))
def test_spread_is_the_population_standard_deviation(scores: list[float]) -> None:
    expected = statistics.pstdev(scores) if len(scores) >= 2 else 0.0
    assert abs(spread(scores) - expected) <= 1e-12


def test_a_document_the_model_clearly_prefers_comes_up_from_anywhere() -> None:
    """Retrieval ranks 1-10 hold nothing the model likes, rank 15 the one it does: the
    request-wide blends weigh and normalize on every score, so it comes first (a blend
    settled on the best-ranked half saw flat scores and kept the retrieval order)."""
    scores = [
        0.30,
        0.32,
        0.28,
        0.31,
        0.29,
        0.30,
        0.33,
        0.27,
        0.31,
        0.30,
        0.29,
        0.32,
        0.30,
        0.28,
        0.85,
        0.31,
        0.30,
        0.29,
        0.33,
        0.28,
    ]
    ranks = list(range(1, 21))
    finals = adaptive_scores(ranks, scores)
    assert max(range(20), key=finals.__getitem__) == 14


def test_no_score_is_clipped_for_where_retrieval_put_it() -> None:
    """Two documents below the best-ranked third that outscore it keep their own order,
    the better first (a scale settled on the third clipped both to its top, and ordered
    them by retrieval rank)."""
    scores = [0.1, 0.3, 0.2, 0.6, 0.1, 0.1, 0.8, 0.95]
    finals = adaptive_scores(list(range(1, 9)), scores)
    assert finals[7] > finals[6] > finals[3]


@given(
    st.floats(0.0, 1.0),
    st.floats(0.0, 1.0),
    st.floats(0.0, 1.0),
    st.lists(st.tuples(st.integers(1, 200), st.none() | st.floats(-5.0, 5.0)), max_size=30),
)
def test_a_settled_blend_scores_a_request_at_once_as_one_by_one(
    weight: float, a: float, b: float, ranked: list[tuple[int, float | None]]
) -> None:
    """`finals`, the loop over a whole request, is `final` of each, and `final` is the
    weighted sum of `normalized` (which the profile fit reads) and the retrieval input."""
    settled = Settled(weight, min(a, b), max(a, b))
    assert (
        settled.finals(ranked)
        == [settled.final(r, p) for r, p in ranked]
        == [
            weight * settled.normalized(r, p) + (1.0 - weight) * retrieval_input(r)
            for r, p in ranked
        ]
    )


def _shipped(name: str) -> AdaptiveParams:
    return next(p.params for p in blend_profiles.load().profiles if p.name == name)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(2, 1000),
    st.data(),
    st.floats(0.0, 0.3),
    st.floats(0.4, 0.69),
    st.randoms(use_true_random=False),
)
def test_a_clear_favourite_comes_first_at_any_list_length(
    n: int, data: st.DataObject, base: float, lead: float, rnd: random.Random
) -> None:
    """One document the model clearly prefers (a lead of 0.4 or more over the rest, which
    are nearly equal) comes first from any retrieval position, among 2 or 1,000
    candidates, under `adaptive` and under the shipped MiniLM profile: its evidence does
    not shrink with the length of the list."""
    needle = data.draw(st.integers(0, n - 1), label="needle position")
    scores = [base + rnd.uniform(0.0, 0.01) for _ in range(n)]
    scores[needle] = base + lead
    ranks = list(range(1, n + 1))
    for params in (ADAPTIVE, _shipped("minilm-l6")):
        finals = adaptive_scores(ranks, list(scores), params)
        assert max(range(n), key=lambda i: (finals[i], -ranks[i])) == needle


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 1000), st.randoms(use_true_random=False))
def test_compressed_noise_leaves_the_retrieval_order_at_any_list_length(
    n: int, rnd: random.Random
) -> None:
    """Scores like the weak stand-in's (0.50..0.56) give the model no weight however many
    candidates there are: the retrieval order."""
    noise = [rnd.uniform(0.50, 0.56) for _ in range(n)]
    for params in (ADAPTIVE, _shipped("minilm-l6")):
        assert adaptive_weight(noise, params) == 0.0


@given(st.lists(st.floats(0.0, 1.0), min_size=0, max_size=REFERENCE_DEPTH))
def test_evidence_is_the_spread_up_to_the_reference_depth(scores: list[float]) -> None:
    assert evidence(scores) == spread(scores)


@given(
    st.floats(0.0, 0.5),
    st.floats(0.0, 0.5),
    st.integers(REFERENCE_DEPTH, 2000),
    st.integers(REFERENCE_DEPTH, 2000),
)
def test_one_favourite_among_equals_has_the_same_evidence_at_any_length(
    base: float, lead: float, n: int, m: int
) -> None:
    """At the reference depth the evidence is the spread; past it, one favourite among
    equal scores keeps exactly that evidence (the spread itself falls like 1/sqrt(n))."""

    def favourite(length: int) -> list[float]:
        return [base] * (length - 1) + [base + lead]

    assert evidence(favourite(n)) == pytest.approx(evidence(favourite(m)), abs=1e-12)
    assert evidence(favourite(n)) == pytest.approx(spread(favourite(REFERENCE_DEPTH)), abs=1e-12)


def test_noise_gains_little_evidence_from_a_longer_list() -> None:
    """Independent noise: the evidence grows with the list only as its best grows over
    its mean, under a quarter more at 1,000 candidates than at 20 (median of 200)."""
    rnd = random.Random(11)

    def median_evidence(n: int) -> float:
        return statistics.median(
            evidence([rnd.gauss(0.5, 0.055) for _ in range(n)]) for _ in range(200)
        )

    at_20, at_100, at_1000 = median_evidence(20), median_evidence(100), median_evidence(1000)
    assert at_20 < at_100 < at_1000 < 1.25 * at_20


@given(
    st.lists(st.floats(0.0, 1.0), min_size=REFERENCE_DEPTH + 1, max_size=200),
    st.floats(1.0, 5.0),
    st.floats(-0.5, 0.5),
)
def test_evidence_grows_with_a_stretch_and_ignores_an_offset(
    scores: list[float], stretch: float, shift: float
) -> None:
    mean = sum(scores) / len(scores)
    wider = [mean + (s - mean) * stretch for s in scores]
    assert evidence(wider) >= evidence(scores) - 1e-9
    assert evidence([s + shift for s in scores]) == pytest.approx(evidence(scores), abs=1e-9)
