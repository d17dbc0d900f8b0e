"""The `rerank` backend's reading of scores: probabilities, or logits through a sigmoid."""

from __future__ import annotations

from rerank_server.scoring.backend_pool import BackendPool
from rerank_server.scoring.rerank_api import RerankApiScorer


def test_a_rerank_backend_that_sent_a_logit_is_read_as_logits_from_then_on() -> None:
    """A batch of logits that all happen to lie in 0..1 is not taken as probabilities
    once the backend has shown it sends logits: one scale for every batch, cached too."""
    pool = BackendPool(["http://127.0.0.1:1"], concurrency=4, timeout_s=1, kind="rerank")
    scorer = RerankApiScorer(pool)

    def parse(*values: float) -> list[float]:
        body = {"results": [{"index": i, "relevance_score": v} for i, v in enumerate(values)]}
        return [round(s, 3) for s in scorer.parse(body, len(values)).values()]

    assert parse(0.9, 0.2) == [0.9, 0.2]  # nothing says these are logits yet
    assert parse(2.0, 0.9) == [0.881, 0.711]
    assert parse(0.9, 0.2) == [0.711, 0.55]
