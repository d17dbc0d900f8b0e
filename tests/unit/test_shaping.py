"""Shaping against hand-worked examples: normalization, fusion, dedup, thresholds."""

from __future__ import annotations

import pytest

from rerank_server.domain import (
    Candidate,
    RankedList,
    RerankQuery,
    ScoreKind,
    ThresholdMode,
    ThresholdSpec,
)
from rerank_server.ranking.shaping import _shaped, normalize, shape
from rerank_server.ranking.validation import resolve
from rerank_server.server import request_rules
from rerank_server.settings import Settings

RULES = request_rules(Settings())


def cands(
    ids: str,
    first_index: int = 0,
    scores: list[float] | None = None,
    metadata: list[dict[str, str]] | None = None,
) -> tuple[Candidate, ...]:
    return tuple(
        Candidate(
            id=c,
            text=f"text of {c}",
            index=first_index + i,
            retrieval_rank=i + 1,
            retrieval_score=scores[i] if scores else None,
            metadata=metadata[i] if metadata else {},
        )
        for i, c in enumerate(ids)
    )


def query(
    candidates: tuple[Candidate, ...] = (), lists: tuple[RankedList, ...] = (), **kw: object
) -> RerankQuery:
    return RerankQuery(request_id="r", query="q", candidates=candidates, lists=lists, **kw)  # type: ignore[arg-type]


def test_lexical_scores_are_min_max_normalized() -> None:
    assert normalize([12.0, 8.0, 2.0], ScoreKind.LEXICAL)[0] == [1.0, 0.6, 0.0]
    assert normalize([3.0, 3.0], ScoreKind.LEXICAL)[0] == [1.0, 1.0]
    # Ends whose difference overflows a float: still on 0..1, not NaN.
    assert normalize([1.7e308, 0.0, -1.7e308], ScoreKind.LEXICAL)[0] == [1.0, 0.5, 0.0]


def test_similarity_scores_are_clamped() -> None:
    assert normalize([1.2, 0.5, -0.1], ScoreKind.SIMILARITY)[0] == [1.0, 0.5, 0.0]


def test_auto_reads_scores_beyond_one_as_lexical() -> None:
    assert normalize([0.9, 0.2], ScoreKind.AUTO) == ([0.9, 0.2], ScoreKind.SIMILARITY)
    assert normalize([7.5, 2.5], ScoreKind.AUTO) == ([1.0, 0.0], ScoreKind.LEXICAL)
    assert normalize([None, 2.0], ScoreKind.AUTO)[0] == [None, 1.0]


def test_rrf_with_bonus_on_a_hand_worked_example() -> None:
    """vector: a b c, bm25: c a d; both original-query lists (weight 2, k 60).

    a = 2/61 + .05 + 2/62 + .02 = .135045;  c = 2/63 + .02 + 2/61 + .05 = .134533
    b = 2/62 + .02 = .052258;               d = 2/63 + .02 = .051746
    """
    q = query(lists=(RankedList("vector", cands("abc")), RankedList("bm25", cands("cad", 3))))
    shaped = shape(resolve(q, RULES))
    assert [c.id for c in shaped.candidates] == ["a", "c", "b", "d"]
    assert [c.retrieval_rank for c in shaped.candidates] == [1, 2, 3, 4]
    a = 2 / 61 + 0.05 + 2 / 62 + 0.02
    expected = [1.0, (2 / 63 + 0.02 + 2 / 61 + 0.05) / a, (2 / 62 + 0.02) / a, (2 / 63 + 0.02) / a]
    assert [c.normalized_score for c in shaped.candidates] == pytest.approx(expected)
    assert [c.found_in for c in shaped.candidates] == [
        ("vector", "bm25"),
        ("vector", "bm25"),
        ("vector",),
        ("bm25",),
    ]
    assert shaped.deduplicated == 2
    # The kept occurrence is the best-ranked one: a from vector (index 0), c from bm25.
    assert [c.index for c in shaped.candidates] == [0, 3, 1, 5]


def test_expansion_lists_weigh_half_and_explicit_weights_win() -> None:
    """orig: a b; expansion: b a. a = 2/61+.05 + 1/62+.02; b = 2/62+.02 + 1/61+.05."""
    q = query(
        lists=(RankedList("orig", cands("ab")), RankedList("exp", cands("ba", 2), expansion=True))
    )
    assert [c.id for c in shape(resolve(q, RULES)).candidates] == ["a", "b"]
    flipped = query(
        lists=(
            RankedList("orig", cands("ab"), weight=1.0),
            RankedList("exp", cands("ba", 2), expansion=True, weight=5.0),
        )
    )
    assert [c.id for c in shape(resolve(flipped, RULES)).candidates] == ["b", "a"]


def test_fusion_k_sets_how_fast_credit_falls_with_rank() -> None:
    """One list a b c: c/a is (2/63+.02)/(2/61+.05) at k=60, (2/4+.02)/(2/2+.05) at k=1."""
    lists = (RankedList("x", cands("abc")),)
    default = shape(resolve(query(lists=lists), RULES)).candidates
    sharp = shape(resolve(query(lists=lists, fusion_k=1), RULES)).candidates
    assert default[2].normalized_score == pytest.approx((2 / 63 + 0.02) / (2 / 61 + 0.05))
    assert sharp[2].normalized_score == pytest.approx((2 / 4 + 0.02) / (2 / 2 + 0.05))


def test_candidates_beside_lists_count_as_one_more_original_list() -> None:
    q = query(candidates=cands("xy"), lists=(RankedList("bm25", cands("yz", 2)),))
    shaped = shape(resolve(q, RULES))
    assert [c.id for c in shaped.candidates] == ["y", "x", "z"]
    assert shaped.candidates[0].found_in == ("candidates", "bm25")


def test_dedup_key_merges_different_ids_keeping_the_best_ranked() -> None:
    meta = [{"url": "u1"}, {"url": "u2"}, {"url": "u1"}, {}]
    q = query(candidates=cands("abcd", metadata=meta), dedup_key="url")
    shaped = shape(resolve(q, RULES))
    assert [c.id for c in shaped.candidates] == ["a", "b", "d"]
    assert shaped.deduplicated == 1


def test_an_empty_dedup_key_value_merges_nothing() -> None:
    """`url: ""` is no url: b, c and d used to merge into one."""
    meta = [{"url": "x"}, {"url": ""}, {"url": ""}, {"url": ""}, {}]
    shaped = shape(resolve(query(candidates=cands("abcde", metadata=meta), dedup_key="url"), RULES))
    assert [c.id for c in shaped.candidates] == ["a", "b", "c", "d", "e"]
    assert shaped.deduplicated == 0


def test_a_list_of_weight_zero_counts_for_nothing() -> None:
    """Its rank bonus (.05 for rank 1) used to count without its weight, and lifted d from
    fourth to second."""
    q = query(
        lists=(RankedList("main", cands("abcd")), RankedList("ignored", cands("d", 4), weight=0.0))
    )
    shaped = shape(resolve(q, RULES))
    assert [c.id for c in shaped.candidates] == ["a", "b", "c", "d"]
    assert shaped.candidates[3].found_in == ("main", "ignored")


def test_equal_fused_scores_tie_and_the_tie_break_decides() -> None:
    """Three lists, each led by another of x, y, z: mathematically equal sums, added in
    other orders, differed in the last bit and ordered y, z, x; the documented tie-break
    (best rank in any list, then the earlier index) gives x, y, z."""
    for weight in (None, 255069.0):  # a large weight: rounding to decimals would not do
        lists = (
            RankedList("l1", cands("xyz"), weight=weight),
            RankedList("l2", cands("yzx", 3), weight=weight),
            RankedList("l3", cands("zxy", 6), weight=weight),
        )
        shaped = shape(resolve(query(lists=lists), RULES))
        assert [c.id for c in shaped.candidates] == ["x", "y", "z"], weight
        assert len({c.normalized_score for c in shaped.candidates}) == 1


def test_dedup_links_groups_through_ids_and_keys() -> None:
    """a~b share a key; b appears again in another list; one document in the end."""
    lists = (
        RankedList("v", cands("ab", metadata=[{"k": "1"}, {"k": "1"}])),
        RankedList("w", cands("b", 2)),
    )
    shaped = shape(resolve(query(lists=lists, dedup_key="k"), RULES))
    assert [c.id for c in shaped.candidates] == ["a"]
    assert shaped.candidates[0].found_in == ("v", "w")
    assert shaped.deduplicated == 2


def test_single_list_keeps_its_given_ranks() -> None:
    given = tuple(
        Candidate(id=c, text=c, index=i, retrieval_rank=r)
        for i, (c, r) in enumerate([("a", 3), ("b", 1), ("c", 2)])
    )
    shaped = shape(resolve(query(candidates=given), RULES))
    assert [c.id for c in shaped.candidates] == ["b", "c", "a"]


def scored(values: list[float]) -> tuple[Candidate, ...]:
    return cands("abcdefghij"[: len(values)], scores=values)


def test_adaptive_threshold_converges_early() -> None:
    """top_k 4 needs ceil(0.8*4) = 4 passing: 0.75 lets 2 through, 0.70 lets 4."""
    q = query(
        candidates=scored([0.9, 0.8, 0.72, 0.71, 0.3, 0.1]),
        top_k=4,
        threshold=ThresholdSpec(ThresholdMode.ADAPTIVE),
    )
    shaped = shape(resolve(q, RULES))
    assert shaped.threshold is not None
    assert shaped.threshold.threshold == pytest.approx(0.70)
    assert shaped.threshold.steps == 1
    assert not shaped.threshold.reached_floor
    assert [c.id for c in shaped.candidates] == ["a", "b", "c", "d"]
    assert shaped.filtered == 2


def test_adaptive_threshold_stops_at_the_floor_and_keeps_what_passed() -> None:
    q = query(
        candidates=scored([0.9, 0.5, 0.36, 0.2, 0.1]),
        top_k=5,
        threshold=ThresholdSpec(ThresholdMode.ADAPTIVE),
    )
    shaped = shape(resolve(q, RULES))
    assert shaped.threshold is not None
    assert shaped.threshold.threshold == pytest.approx(0.35)
    assert shaped.threshold.steps == 8
    assert shaped.threshold.reached_floor
    assert [c.id for c in shaped.candidates] == ["a", "b", "c"]


def test_adaptive_threshold_tries_a_floor_between_two_steps() -> None:
    """start .75, step .3: .45, then the floor .35 itself, where b and c pass. The floor
    used to be tried only when the steps landed on it: `a` alone was kept, at .45, and
    the report said the floor was reached."""
    spec = ThresholdSpec(ThresholdMode.ADAPTIVE, start=0.75, step=0.3, floor=0.35)
    q = query(candidates=scored([0.5, 0.4, 0.38, 0.1]), top_k=4, threshold=spec)
    shaped = shape(resolve(q, RULES))
    assert shaped.threshold is not None
    assert shaped.threshold.threshold == pytest.approx(0.35)
    assert shaped.threshold.steps == 2 and shaped.threshold.reached_floor
    assert [c.id for c in shaped.candidates] == ["a", "b", "c"]


def test_adaptive_threshold_keeps_the_best_when_nothing_passes_the_floor() -> None:
    q = query(
        candidates=scored([0.3, 0.2, 0.1, 0.05]),
        top_k=2,
        threshold=ThresholdSpec(ThresholdMode.ADAPTIVE),
    )
    shaped = shape(resolve(q, RULES))
    assert [c.id for c in shaped.candidates] == ["a", "b"]
    assert shaped.threshold is not None and shaped.threshold.reached_floor


def test_adaptive_threshold_honours_overrides() -> None:
    spec = ThresholdSpec(
        ThresholdMode.ADAPTIVE, start=0.95, step=0.1, floor=0.6, target_fraction=0.5
    )
    q = query(candidates=scored([0.99, 0.9, 0.7, 0.66, 0.5, 0.4]), top_k=6, threshold=spec)
    shaped = shape(resolve(q, RULES))
    assert shaped.threshold is not None
    # need 3: 0.95 -> 1 pass, 0.85 -> 2, 0.75 -> 2, 0.65 -> 4 >= 3.
    assert shaped.threshold.threshold == pytest.approx(0.65)
    assert shaped.threshold.steps == 3
    assert [c.id for c in shaped.candidates] == ["a", "b", "c", "d"]


def test_fixed_threshold() -> None:
    q = query(
        candidates=scored([0.9, 0.6, 0.59]),
        threshold=ThresholdSpec(ThresholdMode.FIXED, min_score=0.6),
    )
    shaped = shape(resolve(q, RULES))
    assert [c.id for c in shaped.candidates] == ["a", "b"]
    assert shaped.threshold is not None and shaped.threshold.steps == 0


def test_threshold_on_lexical_scores_uses_their_normalized_values() -> None:
    """BM25 20, 15, 5, 0 -> 1, .75, .25, 0: a fixed 0.5 keeps two."""
    q = query(
        candidates=scored([20.0, 15.0, 5.0, 0.0]),
        threshold=ThresholdSpec(ThresholdMode.FIXED, min_score=0.5),
    )
    assert [c.id for c in shape(resolve(q, RULES)).candidates] == ["a", "b"]


def test_lexical_top_is_reported_for_the_strong_signal_rule() -> None:
    lists = (
        RankedList("vector", cands("ab", scores=[0.9, 0.8])),
        RankedList("bm25", cands("ba", 2, scores=[14.0, 9.0]), score_kind=ScoreKind.LEXICAL),
    )
    shaped = shape(resolve(query(lists=lists), RULES))
    assert shaped.lexical_top == (1.0, 0.0)
    assert shape(resolve(query(lists=lists[:1]), RULES)).lexical_top is None


def test_shaped_copy_keeps_every_field_as_replace_does() -> None:
    """`_shaped` passes Candidate's fields by position for speed: a field added to
    Candidate, or moved, would be dropped or shifted silently, so pin the fields in order
    and compare with `_replace`."""
    c = Candidate(
        id="a",
        text="t",
        index=3,
        retrieval_rank=2,
        title="T",
        retrieval_score=0.4,
        metadata={"k": "v"},
        normalized_score=0.1,
        found_in=("x",),
    )
    assert Candidate._fields == (
        "id",
        "text",
        "index",
        "retrieval_rank",
        "title",
        "retrieval_score",
        "metadata",
        "normalized_score",
        "found_in",
    ), "update _shaped and convert._candidates"
    assert _shaped(c, 0.7, ("l",)) == c._replace(normalized_score=0.7, found_in=("l",))


def test_unique_ids_in_one_list_keep_their_order_and_name_no_list() -> None:
    """Without `lists`, `found_in` stays empty (the proto: names of the lists that found
    the candidate, with `lists`); it was ("candidates",) in every result until 2026-11-25."""
    shaped = shape(resolve(query(cands("cab", scores=[3.0, 2.0, 1.0])), RULES))
    assert [c.id for c in shaped.candidates] == ["c", "a", "b"]
    assert all(c.found_in == () for c in shaped.candidates)
    assert [c.normalized_score for c in shaped.candidates] == [1.0, 0.5, 0.0]
    assert shaped.deduplicated == 0
