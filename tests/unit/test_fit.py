"""Fitting blend profiles: the metric agrees with ranx, and the fit trusts a scorer exactly
as far as its scores carry signal, judged on queries it did not fit on."""

from __future__ import annotations

import dataclasses
import random
import statistics

import numpy as np
import pytest
from ranx import Qrels, Run, evaluate

from rerank_server.evaluation.fit import Curve, Family, ScoredQuery, fit, grid, ndcg
from rerank_server.evaluation.fit_across import Collection, Constraint, NeedleQuery, fit_across
from rerank_server.evaluation.fit_command import _by_depth
from rerank_server.ranking.blending import (
    ADAPTIVE,
    AdaptiveParams,
    adaptive_weight,
)

DEPTH = 20


def make_queries(
    n: int,
    informative: bool,
    seed: int = 1,
) -> tuple[list[ScoredQuery], dict[str, dict[str, int]]]:
    """Per query, 20 reranked candidates and one tail document.

    Informative: the one highly relevant document sits at BM25 rank 4..7 and the scorer
    gives it 0.4 more than the noise everyone gets. Not: BM25 already has the relevant
    documents on top and the scorer's values are noise.
    """
    rng = random.Random(seed)
    queries, qrels = [], {}
    for q in range(n):
        qid = f"q{q}"
        ids = tuple(f"{qid}-d{r}" for r in range(1, DEPTH + 1))
        if informative:
            relevant = rng.randint(4, -(-DEPTH // 3))
            qrels[qid] = {ids[relevant - 1]: 2, ids[0]: 1}
        else:
            relevant = 0
            qrels[qid] = {ids[0]: 2, ids[1]: 2, ids[2]: 1}
        scores = tuple(
            0.5 + rng.uniform(-0.05, 0.05) + (0.4 if r == relevant else 0.0)
            for r in range(1, DEPTH + 1)
        )
        queries.append(ScoredQuery(qid, ids, tuple(range(1, DEPTH + 1)), scores, (f"{qid}-tail",)))
    return queries, qrels


def mean_ndcg(rankings: dict[str, list[str]], qrels: dict[str, dict[str, int]]) -> float:
    return sum(ndcg(ranked, qrels[q]) for q, ranked in rankings.items()) / len(rankings)


@pytest.mark.filterwarnings("ignore:unsafe cast from uint64 to int64")  # ranx's own
def test_ndcg_agrees_with_ranx() -> None:
    rng = random.Random(3)
    qrels, run = {}, {}
    for q in range(30):
        docs = [f"d{i}" for i in range(25)]
        qrels[f"q{q}"] = {d: rng.choice([0, 1, 2, 3]) for d in rng.sample(docs, 8)}
        rng.shuffle(docs)
        run[f"q{q}"] = docs
    judged = Qrels(qrels)
    ranx_values = evaluate(
        judged,
        Run({q: {d: 1.0 / (i + 1) for i, d in enumerate(ds)} for q, ds in run.items()}),
        "ndcg@10",
        return_mean=False,
    )
    order = list(judged.keys())  # ranx's query order, not the dict's
    ours = [ndcg(run[q], qrels[q]) for q in order]
    assert ours == pytest.approx([float(v) for v in ranx_values])


def test_grid_starts_with_the_retrieval_order_and_covers_full_trust() -> None:
    gated = grid([0.01, 0.05, 0.2], [0.3, 0.6, 0.9])
    assert gated[0] == AdaptiveParams(0.0, 0.0, 0.0, 0.0)
    assert ADAPTIVE in gated  # the built-in blend, no gate
    # Otherwise the built-in spread ramp under a gate cut at the best scores' deciles.
    assert all(
        p == gated[0]
        or (p.spread_noise, p.spread_decisive, p.min_weight, p.max_weight) == (0.06, 0.10, 0.0, 1.0)
        for p in gated
    )
    assert {p.top_floor for p in gated} == {0.0, 0.3, 0.6, 0.9}
    full = grid([0.01, 0.05, 0.2], [0.3, 0.6, 0.9], Family.FULL)
    assert full[0] == gated[0] and AdaptiveParams(0.0, 0.0, 1.0, 1.0) in full
    assert all(p.spread_noise in {0.0, 0.01, 0.05, 0.2} for p in full)


@pytest.mark.parametrize("seed", range(4))
def test_the_fast_curve_agrees_with_the_exact_replay(seed: int) -> None:
    """The fit looks values up on each query's step function of the weight; the server
    blends with adaptive_scores. They must agree at every weight a profile can give."""
    rng = random.Random(seed)
    queries, qrels = make_queries(12, informative=bool(seed % 2), seed=seed)
    failed = [
        ScoredQuery(
            q.qid,
            q.ids,
            q.ranks,
            tuple(None if rng.random() < 0.2 else s for s in q.scores),
            q.rest,
        )
        for q in queries
    ]
    for q in failed:
        curve = Curve(q, qrels[q.qid])
        for _ in range(25):
            params = AdaptiveParams(0.0, 0.0, w := rng.choice([0.0, 0.25, 1.0, rng.random()]), w)
            expected = ndcg(q.ordered(params), qrels[q.qid])
            weight = adaptive_weight(q.present, params)
            near = np.abs(curve.steps - weight) < 1e-9
            if near.any():
                # Exactly where two candidates tie (clipped scores make round weights
                # such as 0.25 land on a crossing), rounding decides their order in
                # either path: the replay is one side of the step or the other.
                sides = curve.at(np.array([weight - 1e-6, weight + 1e-6]))
                assert any(float(v) == pytest.approx(expected) for v in sides)
                continue
            assert float(curve.at(np.array([weight]))[0]) == pytest.approx(expected)


def test_a_decisive_scorer_is_trusted_and_a_noisy_one_is_not() -> None:
    strong, strong_qrels = make_queries(40, informative=True)
    strong_fit = fit(strong, strong_qrels)
    assert strong_fit.params.max_weight == 1.0
    strong_bm25 = mean_ndcg({q.qid: list(q.ids) for q in strong}, strong_qrels)
    # Out of fold it keeps most of what full trust could add (the gate's thresholds,
    # fitted on the other folds, hold a few queries back).
    assert strong_fit.cross_validated > strong_bm25 + 0.5 * (1.0 - strong_bm25)

    weak, weak_qrels = make_queries(40, informative=False)
    weak_fit = fit(weak, weak_qrels)
    assert weak_fit.params == AdaptiveParams(0.0, 0.0, 0.0, 0.0)  # the retrieval order
    weak_bm25 = mean_ndcg({q.qid: list(q.ids) for q in weak}, weak_qrels)
    assert weak_fit.in_sample == pytest.approx(weak_bm25) == 1.0
    # The out-of-fold figure is the honest one, and it is what the in-sample one says.
    assert weak_fit.cross_validated == pytest.approx(mean_ndcg(weak_fit.out_of_fold, weak_qrels))


def test_cross_validation_ranks_every_query_once_with_params_fitted_elsewhere() -> None:
    queries, qrels = make_queries(23, informative=True)
    result = fit(queries, qrels, folds=5)
    assert set(result.out_of_fold) == {q.qid for q in queries}
    assert len(result.fold_params) == 5
    for q in queries:
        ranked = result.out_of_fold[q.qid]
        assert sorted(ranked) == sorted(q.ids + q.rest) and ranked[-1] == q.rest[0]
    assert 0.0 <= result.cross_validated <= 1.0


def test_failed_pairs_keep_their_retrieval_place_in_the_replay() -> None:
    q = ScoredQuery("q", ("a", "b", "c"), (1, 2, 3), (None, 0.9, 0.1), ())
    # Full trust: b (0.9 -> 1.0 normalized) first; a's stand-in is 1/rank = 1.0, tie
    # broken by retrieval rank, so a stays ahead of b.
    assert q.ordered(AdaptiveParams(0.0, 0.0, 1.0, 1.0)) == ["a", "b", "c"]
    with pytest.raises(ValueError, match="no reranked queries"):
        fit([], {})


def collection(name: str, n: int, readable: bool, seed: int) -> Collection:
    """Readable: the relevant document sits at BM25 rank 4..7 and gets the best score,
    0.9, above noise at 0.3..0.6. Unreadable (a model on a script it cannot read): BM25
    already has it first, and the scores spread as widely but stay low (0..0.45), with
    the relevant document near the bottom: the spread alone would trust them fully."""
    rng = random.Random(seed)
    queries, qrels = [], {}
    for q in range(n):
        qid = f"{name}-q{q}"
        ids = tuple(f"{qid}-d{r}" for r in range(1, DEPTH + 1))
        relevant = rng.randint(4, -(-DEPTH // 3)) if readable else 1
        qrels[qid] = {ids[relevant - 1]: 1}
        scores = tuple(
            (0.9 if r == relevant else rng.uniform(0.3, 0.6))
            if readable
            else (0.02 if r == relevant else rng.uniform(0.0, 0.45))
            for r in range(1, DEPTH + 1)
        )
        queries.append(ScoredQuery(qid, ids, tuple(range(1, DEPTH + 1)), scores, ()))
    return Collection(name, tuple(queries), qrels)


def test_fit_across_gates_out_the_collection_the_scorer_cannot_read() -> None:
    readable = collection("english", 30, readable=True, seed=1)
    unreadable = collection("arabic", 30, readable=False, seed=2)
    assert adaptive_weight(unreadable.queries[0].present) == 1.0  # spread: fully trusted
    result = fit_across([readable, unreadable])

    def mean(choice_values: list[float]) -> float:
        return sum(choice_values) / len(choice_values)

    everything = result.everything
    assert everything.fitted_on == ("english", "arabic")
    assert 0.0 < everything.params.top_floor <= everything.params.top_full <= 0.9
    assert mean(everything.per_query["arabic"]) == mean(result.bm25["arabic"]) == 1.0
    assert mean(everything.per_query["english"]) == pytest.approx(mean(result.reranker["english"]))
    assert mean(result.reranker["arabic"]) < 0.5  # what an ungated blend would give
    # Held out: each is scored with the parameters fitted on the other alone. Fitted on
    # the unreadable one, the reranker is not trusted (most cautious of equals).
    assert set(result.held_out) == {"english", "arabic"}
    assert result.held_out["english"].fitted_on == ("arabic",)
    assert result.held_out["english"].params.max_weight == 0.0
    assert mean(result.held_out["english"].per_query["english"]) == pytest.approx(
        mean(result.bm25["english"])
    )
    with pytest.raises(ValueError, match="reranked queries"):
        fit_across([Collection("empty", (), {})])


def test_a_profile_that_reads_one_script_gives_the_others_no_weight() -> None:
    """The unreadable collection's requests are in another script: with `scripts` the fit
    replays them in retrieval order, as the server will answer them, so nothing needs a
    gate on the best score, and the readable one keeps pure reranking's gain."""
    readable = collection("english", 30, readable=True, seed=1)
    unreadable = collection("arabic", 30, readable=False, seed=2)
    arabic = Collection(
        "arabic",
        tuple(dataclasses.replace(q, script="Arabic") for q in unreadable.queries),
        unreadable.qrels,
    )
    english = Collection(
        "english",
        tuple(dataclasses.replace(q, script="Latin") for q in readable.queries),
        readable.qrels,
    )
    result = fit_across([english, arabic], Family.RAMP, Constraint(0.0, ("Latin",)))
    per_query = result.everything.per_query
    assert statistics.fmean(per_query["arabic"]) == statistics.fmean(result.bm25["arabic"])
    english, bm25 = statistics.fmean(per_query["english"]), statistics.fmean(result.bm25["english"])
    assert english >= 0.95 * statistics.fmean(result.reranker["english"]) and english > bm25 + 0.3
    assert result.everything.params.top_full == 0.0  # the script does the distrusting


def needle_collection(margin: float, n: int = 40, seed: int = 3) -> Collection:
    """Needle requests whose relevant document, at rank 11..20, scores `margin` above the
    noise (0.40..0.48) the others get; judged queries on which BM25 is perfect, so that
    nDCG@10 alone prefers the retrieval order."""
    rng = random.Random(seed)
    needles, queries, qrels = [], [], {}
    for q in range(n):
        ids = tuple(f"n{q}-d{r}" for r in range(1, 21))
        at = rng.randint(11, 20)
        scores = tuple(0.44 + margin if r == at else rng.uniform(0.40, 0.48) for r in range(1, 21))
        needles.append(
            NeedleQuery(ScoredQuery(f"n{q}", ids, tuple(range(1, 21)), scores, ()), ids[at - 1])
        )
        queries.append(ScoredQuery(f"q{q}", ids, tuple(range(1, 21)), scores, ()))
        qrels[f"q{q}"] = {ids[0]: 2, ids[1]: 1}
    return Collection("c", tuple(queries), qrels, tuple(needles))


def test_the_needle_share_rules_out_a_blend_that_keeps_the_needle_down() -> None:
    """nDCG@10 alone picks the retrieval order here; asked for the needle case, the fit
    takes the first choice in its order that lifts the needle as often as pure
    reranking does (or, when none can, says so)."""
    c = needle_collection(margin=0.2)
    assert c.needle_reranked() == 1.0
    unconstrained = fit_across([c], Family.RAMP)
    assert c.needle_rate(unconstrained.everything.params) < 0.9
    constrained = fit_across([c], Family.RAMP, Constraint(0.9))
    assert constrained.needle_met
    assert c.needle_rate(constrained.everything.params) >= 0.9
    impossible = fit_across([c], Family.RAMP, Constraint(1.5))
    assert not impossible.needle_met
    assert impossible.everything.params == unconstrained.everything.params


def test_one_data_set_at_two_depths_is_held_out_at_both() -> None:
    """A data set evaluated at 20 and at 100 candidates is two collections for the fit,
    but never fitted on while it is held out: held out, it gets the parameters fitted on
    the other data sets alone."""
    shallow = dataclasses.replace(
        collection("english", 20, readable=True, seed=1), name="english@20", dataset="english"
    )
    deep = dataclasses.replace(
        collection("english", 20, readable=True, seed=4), name="english@100", dataset="english"
    )
    other = collection("arabic", 20, readable=False, seed=2)
    result = fit_across([shallow, deep, other])
    assert result.held_out["english@20"].fitted_on == ("arabic",)
    assert result.held_out["english@100"].fitted_on == ("arabic",)
    assert result.held_out["arabic"].fitted_on == ("english@20", "english@100")


def test_a_data_set_given_at_two_depths_is_named_by_depth() -> None:
    twenty = collection("vaswani", 3, readable=True, seed=1)
    hundred_queries = tuple(
        dataclasses.replace(
            q, ids=q.ids * 5, ranks=tuple(range(1, 5 * len(q.ids) + 1)), scores=q.scores * 5
        )
        for q in twenty.queries
    )
    hundred = dataclasses.replace(twenty, queries=hundred_queries)
    alone = collection("trec", 3, readable=True, seed=2)
    named = _by_depth([(twenty, "b", "m"), (hundred, "b", "m"), (alone, "b", "m")])
    assert [c.name for c, _, _ in named] == [f"vaswani@{DEPTH}", f"vaswani@{5 * DEPTH}", "trec"]
    assert {c.source for c, _, _ in named} == {"vaswani", "trec"}
