"""Fusion, thresholds and skip rules end to end: client, gRPC server, fake llama-server."""

from __future__ import annotations

import pytest
from rerank_client import AsyncRerankClient, InvalidRequestError, RankedList, Threshold

from tests.conftest import StartServer, client_of
from tests.fakes.llama import FakeLlamaServer


async def test_two_lists_are_fused_deduplicated_and_each_document_scored_once(
    client: AsyncRerankClient, fake_llama: FakeLlamaServer
) -> None:
    vector = RankedList(
        "vector",
        [{"id": "a", "text": "alpha"}, {"id": "b", "text": "beta"}, {"id": "c", "text": "gamma"}],
    )
    bm25 = RankedList(
        "bm25",
        [
            {"id": "c", "text": "gamma", "retrieval_score": 11.0},
            {"id": "a", "text": "alpha", "retrieval_score": 7.0},
            {"id": "d", "text": "delta", "retrieval_score": 1.0},
        ],
    )
    answer = await client.rerank("q", lists=[vector, bm25], blend_strategy="rerank_only")
    # Equal fake scores: rerank_only keeps the fused order a, c, b, d.
    assert [r.id for r in answer.results] == ["a", "c", "b", "d"]
    assert [r.retrieval_rank for r in answer.results] == [1, 2, 3, 4]
    assert answer.results[0].found_in == ("vector", "bm25")
    assert answer.results[3].found_in == ("bm25",)
    assert answer.results[0].normalized_retrieval_score == pytest.approx(1.0)
    assert answer.results[1].retrieval_score == 11.0  # the kept occurrence's, echoed
    assert answer.summary.candidates == 6
    assert answer.summary.deduplicated == 2
    assert sorted(fake_llama.documents()) == ["alpha", "beta", "delta", "gamma"]


async def test_adaptive_threshold_filters_before_scoring_and_is_reported(
    client: AsyncRerankClient, fake_llama: FakeLlamaServer
) -> None:
    docs = [
        {"text": f"doc {i}", "retrieval_score": s}
        for i, s in enumerate([0.9, 0.8, 0.72, 0.71, 0.3, 0.1])
    ]
    answer = await client.rerank("q", docs, top_k=4, threshold=Threshold.adaptive())
    threshold = answer.summary.threshold
    assert threshold is not None
    assert threshold.threshold == pytest.approx(0.70) and threshold.steps == 1
    assert threshold.passed == 4 and not threshold.reached_floor
    assert answer.summary.filtered == 2
    assert len(fake_llama.requests) == 4
    assert {r.id for r in answer.results} == {"0", "1", "2", "3"}


async def test_skip_within_top_k_is_reported_and_scores_nothing(
    client: AsyncRerankClient, fake_llama: FakeLlamaServer
) -> None:
    answer = await client.rerank("q", ["a", "b", "c"], top_k=3, skip_within_top_k=True)
    assert not answer.reranked
    assert answer.summary.degraded_code == "within_top_k"
    assert [r.id for r in answer.results] == ["0", "1", "2"]
    assert fake_llama.requests == []
    # Off by default: the same request without the flag is scored.
    assert (await client.rerank("q", ["a", "b", "c"], top_k=3)).reranked


async def test_strong_signal_skip_keeps_retrieval_order(
    start_server: StartServer, fake_llama: FakeLlamaServer
) -> None:
    server = await start_server(strong_signal_skip=True)
    bm25 = [
        {"text": t, "retrieval_score": s}
        for t, s in [("exact match", 20.0), ("weak", 9.0), ("weaker", 5.0), ("none", 1.0)]
    ]
    close = [
        {"text": t, "retrieval_score": s}
        for t, s in [("one", 20.0), ("two", 19.0), ("three", 5.0), ("four", 1.0)]
    ]
    async with client_of(server) as client:
        clear = await client.rerank("q", bm25)
        assert clear.summary.degraded_code == "strong_signal"
        assert [r.id for r in clear.results] == ["0", "1", "2", "3"]
        assert fake_llama.requests == []
        assert (await client.rerank("q", close)).reranked  # lead 1/19 < 0.15: scored
        # A request can turn the rule off.
        assert (await client.rerank("q", bm25, strong_signal_skip=False)).reranked


async def test_min_candidates_counts_after_deduplication(
    start_server: StartServer, fake_llama: FakeLlamaServer
) -> None:
    server = await start_server(min_candidates=3)
    lists = [
        RankedList("v", [{"id": "a", "text": "x"}, {"id": "b", "text": "y"}]),
        RankedList("w", [{"id": "b", "text": "y"}, {"id": "a", "text": "x"}]),
    ]
    async with client_of(server) as client:
        answer = await client.rerank("q", lists=lists)
    assert answer.summary.degraded_code == "too_few_candidates"
    assert fake_llama.requests == []


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"lists": [RankedList("v", ["x"]), RankedList("v", ["y"])]}, "lists[1].name"),
        ({"lists": [RankedList("candidates", ["y"])], "candidates": ["x"]}, "lists[0].name"),
        ({"lists": [RankedList("v", ["x"], weight=-1.0)]}, "lists[0].weight"),
        (
            {"lists": [RankedList("v", [{"id": "a", "text": "x"}, {"id": "a", "text": "y"}])]},
            "lists[0].candidates[1].id",
        ),
        ({"lists": [RankedList(f"l{i}", ["x"]) for i in range(9)]}, "lists"),
        ({"candidates": ["x"], "threshold": Threshold.fixed(0.5)}, "options.threshold"),
        (
            {
                "candidates": [{"text": "x", "retrieval_score": 0.5}],
                "threshold": Threshold.adaptive(start=0.4, floor=0.6),
            },
            "options.threshold.floor",
        ),
        (
            {
                "candidates": [{"text": "x", "retrieval_score": 0.5}],
                "threshold": Threshold.fixed(1.5),
            },
            "options.threshold.min_score",
        ),
        ({"candidates": ["x"], "fusion_k": 0}, "options.fusion_k"),
    ],
)
async def test_bad_shaping_options_name_the_field(
    client: AsyncRerankClient, options: dict[str, object], field: str
) -> None:
    candidates = options.pop("candidates", [])
    with pytest.raises(InvalidRequestError) as info:
        await client.rerank("q", candidates, **options)  # type: ignore[arg-type]
    assert info.value.message.startswith(f"{field}: ")
