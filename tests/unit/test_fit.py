"""Fitting blend profiles: the metric agrees with ranx, and the fit trusts a scorer exactly
as far as its scores carry signal, judged on queries it did not fit on."""

from __future__ import annotations

import random

import pytest
from ranx import Qrels, Run, evaluate

from rerank_server.evaluation.fit import ScoredQuery, fit, grid, ndcg
from rerank_server.ranking.blending import AdaptiveParams

DEPTH = 20


def make_queries(n: int, informative: bool, seed: int = 1,
                 ) -> tuple[list[ScoredQuery], dict[str, dict[str, int]]]:
    """Per query, 20 reranked candidates and one tail document.

    Informative: the one highly relevant document sits at BM25 rank 8..20 and the scorer
    gives it 0.4 more than the noise everyone gets. Not: BM25 already has the relevant
    documents on top and the scorer's values are noise.
    """
    rng = random.Random(seed)
    queries, qrels = [], {}
    for q in range(n):
        qid = f"q{q}"
        ids = tuple(f"{qid}-d{r}" for r in range(1, DEPTH + 1))
        if informative:
            relevant = rng.randint(8, DEPTH)
            qrels[qid] = {ids[relevant - 1]: 2, ids[0]: 1}
        else:
            relevant = 0
            qrels[qid] = {ids[0]: 2, ids[1]: 2, ids[2]: 1}
        scores = tuple(0.5 + rng.uniform(-0.05, 0.05) + (0.4 if r == relevant else 0.0)
                       for r in range(1, DEPTH + 1))
        queries.append(ScoredQuery(qid, ids, tuple(range(1, DEPTH + 1)), scores,
                                   (f"{qid}-tail",)))
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
    ranx_values = evaluate(judged, Run({q: {d: 1.0 / (i + 1) for i, d in enumerate(ds)}
                                        for q, ds in run.items()}),
                           "ndcg@10", return_mean=False)
    order = list(judged.keys())  # ranx's query order, not the dict's
    ours = [ndcg(run[q], qrels[q]) for q in order]
    assert ours == pytest.approx([float(v) for v in ranx_values])


def test_grid_starts_with_the_retrieval_order_and_covers_full_trust() -> None:
    candidates = grid([0.01, 0.05, 0.2])
    assert candidates[0] == AdaptiveParams(0.0, 0.0, 0.0, 0.0)
    assert AdaptiveParams(0.0, 0.0, 1.0, 1.0) in candidates
    assert all(p.spread_noise in {0.0, 0.01, 0.05, 0.2} for p in candidates)


def test_a_decisive_scorer_is_trusted_and_a_noisy_one_is_not() -> None:
    strong, strong_qrels = make_queries(40, informative=True)
    strong_fit = fit(strong, strong_qrels)
    assert strong_fit.params.max_weight >= 0.75
    strong_bm25 = mean_ndcg({q.qid: list(q.ids) for q in strong}, strong_qrels)
    assert strong_fit.cross_validated > strong_bm25 + 0.2

    weak, weak_qrels = make_queries(40, informative=False)
    weak_fit = fit(weak, weak_qrels)
    assert weak_fit.params == AdaptiveParams(0.0, 0.0, 0.0, 0.0)  # the retrieval order
    weak_bm25 = mean_ndcg({q.qid: list(q.ids) for q in weak}, weak_qrels)
    assert weak_fit.in_sample == pytest.approx(weak_bm25) == 1.0
    # The out-of-fold figure is the honest one, and it is what the in-sample one says.
    assert weak_fit.cross_validated == pytest.approx(
        mean_ndcg(weak_fit.out_of_fold, weak_qrels))


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
