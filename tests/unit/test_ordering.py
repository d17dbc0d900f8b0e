"""The incremental ordering: releases are always the final order, and only when certain."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from rerank_server.domain import BlendStrategy, Candidate
from rerank_server.ranking import blending
from rerank_server.ranking.blending import AdaptiveParams
from rerank_server.ranking.ordering import IncrementalRanking
from tests.blend_oracle import final_scores, order_key


def _cands(n: int) -> list[Candidate]:
    return [Candidate(id=str(i), text="", index=i, retrieval_rank=i + 1) for i in range(n)]


profiles = st.builds(
    lambda noise, width, low, extra, floor, gate: AdaptiveParams(
        noise, noise + width, low, min(1.0, low + extra), floor, min(1.0, floor + gate)
    ),
    st.floats(0, 0.3),
    st.floats(0, 0.3),
    st.floats(0, 1),
    st.floats(0, 1),
    st.floats(0, 0.9),
    st.floats(0, 0.5),
)


@given(
    st.lists(st.one_of(st.none(), st.floats(0, 1)), min_size=0, max_size=25),
    st.sampled_from(list(BlendStrategy)),
    st.randoms(use_true_random=False),
    st.integers(0, 5),
    profiles,
)
def test_released_order_equals_full_sort(
    scores: list[float | None],
    strategy: BlendStrategy,
    rnd: random.Random,
    tail_len: int,
    params: AdaptiveParams,
) -> None:
    """Whatever the scores, blend, profile and arrival order: what `RerankStream` sends
    as it goes is what `Rerank` sorts at the end."""
    cands = _cands(len(scores) + tail_len)
    scored, tail = cands[: len(scores)], cands[len(scores) :]
    ranking = IncrementalRanking(strategy, scored, tail, lambda: params)
    released = []
    order = list(range(len(scores)))
    rnd.shuffle(order)
    for i in order:
        ranking.resolve(i, scores[i])
        released += ranking.release()
    released += ranking.release()
    finals = final_scores(strategy, [c.retrieval_rank for c in scored], scores, params)
    expected = sorted(
        scored,
        key=lambda c: order_key(
            strategy, c.retrieval_rank, c.index, finals[c.index], scores[c.index]
        ),
    )
    assert [p.candidate for p in released] == expected + tail


@given(
    st.lists(st.one_of(st.none(), st.floats(0, 1)), min_size=0, max_size=25),
    st.sampled_from(list(BlendStrategy)),
    st.randoms(use_true_random=False),
    profiles,
)
def test_outcomes_arriving_in_groups_release_what_one_by_one_would(
    scores: list[float | None], strategy: BlendStrategy, rnd: random.Random, params: AdaptiveParams
) -> None:
    """A batch's outcomes are resolved together (`resolve_all`, which settles a
    request-wide blend once per group): after each group, what is released is what
    resolving the same outcomes one by one releases."""
    order = list(range(len(scores)))
    rnd.shuffle(order)
    groups: list[list[int]] = []
    while order:
        size = rnd.randint(1, len(order))
        groups.append(order[:size])
        order = order[size:]
    single = IncrementalRanking(strategy, _cands(len(scores)), [], lambda: params)
    grouped = IncrementalRanking(strategy, _cands(len(scores)), [], lambda: params)
    for group in groups:
        for i in group:
            single.resolve(i, scores[i])
        grouped.resolve_all((i, scores[i]) for i in group)
        assert grouped.release() == single.release()
        assert grouped.reranker_weight == single.reranker_weight


def test_nothing_released_while_a_better_candidate_may_come() -> None:
    ranking = IncrementalRanking(BlendStrategy.RERANK_ONLY, _cands(3), [])
    ranking.resolve(2, 0.9)
    assert ranking.release() == []  # 0 and 1 could still score above 0.9
    ranking.resolve(0, 0.95)
    assert ranking.release() == []  # 1 could still score 1.0 and beat 0
    ranking = IncrementalRanking(BlendStrategy.RERANK_ONLY, _cands(3), [])
    ranking.resolve(2, 0.9)
    ranking.resolve(0, 1.0)  # ties 1's best case and wins on retrieval rank
    assert [p.candidate.id for p in ranking.release()] == ["0"]  # 1 could still beat 2
    ranking.resolve(1, 0.1)
    assert [p.candidate.id for p in ranking.release()] == ["2", "1"]


def test_decisive_first_answer_is_released_immediately() -> None:
    ranking = IncrementalRanking(BlendStrategy.POSITION_AWARE, _cands(5), [])
    ranking.resolve(0, 0.0)  # rank 1 scores >= 0.75; no other can exceed 0.75
    assert [p.candidate.id for p in ranking.release()] == ["0"]


def test_fail_outstanding_releases_everything() -> None:
    ranking = IncrementalRanking(BlendStrategy.LINEAR, _cands(4), _cands(6)[4:])
    ranking.resolve(3, 1.0)
    assert ranking.fail_outstanding() == [0, 1, 2]
    assert len(ranking.release()) == 6


def test_a_request_wide_blend_releases_once_every_score_is_in() -> None:
    """Its weight and scale depend on every score, so no place nor final score is
    certain before the last: then everything goes out, in the full sort's order."""
    ranking = IncrementalRanking(BlendStrategy.ADAPTIVE, _cands(6), [])
    for i, score in enumerate([0.9, 0.1, 0.2, 0.4, 0.3]):
        ranking.resolve(i, score)
        assert ranking.release() == [] and ranking.reranker_weight is None
    ranking.resolve(5, 0.95)
    assert ranking.reranker_weight == 1.0
    assert [p.candidate.id for p in ranking.release()] == ["5", "0", "3", "4", "2", "1"]


def test_a_blend_that_gives_the_model_no_weight_streams_in_retrieval_order() -> None:
    """Every final score is 1/rank whatever the scores: each result goes out as soon as
    its own score and those of the better-ranked are in."""
    ranking = IncrementalRanking(BlendStrategy.PROFILE, _cands(4), [], lambda: blending.NO_WEIGHT)
    ranking.resolve(1, 0.9)
    assert ranking.release() == [] and ranking.reranker_weight == 0.0
    ranking.resolve(0, 0.1)
    assert [(p.candidate.id, p.score) for p in ranking.release()] == [("0", 1.0), ("1", 0.5)]
    ranking.resolve(3, 0.5)
    ranking.resolve(2, 0.2)
    assert [p.candidate.id for p in ranking.release()] == ["2", "3"]


def test_an_empty_group_settles_nothing() -> None:
    """The pipeline resolves its cache hits as a group even when there are none: with
    nothing scored, a request-wide blend must stay unsettled (no weight to report)."""
    ranking = IncrementalRanking(BlendStrategy.ADAPTIVE, [], _cands(2))
    ranking.resolve_all([])
    assert ranking.reranker_weight is None
    assert [p.candidate.index for p in ranking.release()] == [0, 1]
