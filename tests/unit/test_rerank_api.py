"""The `rerank` backend's reading of scores: probabilities, or logits through a sigmoid;
and answers it cannot trust."""

from __future__ import annotations

from collections.abc import Sequence

from rerank_server.scoring.backends.rerank_api import LOGIT_ANSWERS, RerankApiScorer
from rerank_server.scoring.transport.pool import BackendPool


def _scorer() -> RerankApiScorer:
    pool = BackendPool(["http://127.0.0.1:1"], concurrency=4, timeout_s=1, kind="rerank")
    return RerankApiScorer(pool)


def _parse(
    scorer: RerankApiScorer, *values: float, indexes: Sequence[int] | None = None
) -> dict[int, float]:
    body = {
        "results": [
            {"index": i, "relevance_score": v}
            for i, v in zip(indexes or range(len(values)), values, strict=True)
        ]
    }
    return {i: round(s, 3) for i, s in scorer.parse(body, len(values)).items()}


def test_a_rerank_backend_that_sent_logits_is_read_as_logits_from_then_on() -> None:
    """A batch of logits that all happen to lie in 0..1 is not taken as probabilities
    once the backend has shown it sends logits: one scale for every batch, cached too.
    Shown by LOGIT_ANSWERS answers, not one: a single broken answer put every later
    probability, from every instance, through the sigmoid for good."""
    scorer = _scorer()
    assert _parse(scorer, 0.9, 0.2) == {0: 0.9, 1: 0.2}  # nothing says these are logits
    assert _parse(scorer, 2.0, 0.9) == {0: 0.881, 1: 0.711}  # this answer is, on its own
    assert _parse(scorer, 0.9, 0.2) == {0: 0.9, 1: 0.2}  # one such answer proves nothing
    for _ in range(LOGIT_ANSWERS - 1):
        _parse(scorer, -3.0, 4.0)
    assert _parse(scorer, 0.9, 0.2) == {0: 0.711, 1: 0.55}


def test_scores_read_as_logits_are_cached_apart() -> None:
    """The switch to logits changes the scale: the scores cached before it (0.9 for what
    now reads 0.711) must not answer from then on."""
    scorer = _scorer()
    before = scorer.variant
    _parse(scorer, 2.0, 0.9)
    assert scorer.variant == before == ""  # keys as they were for a probability server
    for _ in range(LOGIT_ANSWERS - 1):
        _parse(scorer, -3.0, 4.0)
    assert scorer.variant == "logits"


def test_two_scores_for_one_document_give_it_none() -> None:
    assert _parse(_scorer(), 0.9, 0.2, 0.5, indexes=[0, 1, 1]) == {0: 0.9}


def test_a_thousand_results_for_three_documents_score_none() -> None:
    body = {"results": [{"index": i % 3, "relevance_score": 0.5} for i in range(1000)]}
    assert _scorer().parse(body, 3) == {}
