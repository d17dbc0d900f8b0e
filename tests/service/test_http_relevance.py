"""What a JSON client reads as relevance, and the shapes each client parses, over real HTTP
on loopback (docs/http.md): scores a client can threshold, no silent caps, `/rerank` for
TEI's, Infinity's and vLLM's bodies, one model name, and `/docs` without a CDN."""

from __future__ import annotations

import random
from typing import Any

import httpx
import pytest

from rerank_server.http_api.app import BLEND_HEADER, DEGRADED_HEADER
from rerank_server.managed.child_process import free_port
from rerank_server.server import RunningServer
from tests.conftest import StartServer
from tests.fakes.llama import HTTP_500, FakeLlamaServer

# Retrieval puts the two off-topic documents first; the model scores them low.
DOCS = [
    "The stock market fell sharply today.",
    "Weather: rain expected in Spain.",
    "Cats are obligate carnivores that eat meat.",
    "Kittens need their mother's milk.",
]
SCORES = {"stock": 0.02, "Weather": 0.05, "Cats": 0.92, "Kittens": 0.81}


@pytest.fixture
async def http_server(
    start_server: StartServer,
    fake_llama: FakeLlamaServer,
) -> RunningServer:
    fake_llama.scores = dict(SCORES)
    return await start_server(http_port=free_port())


def _said(index: int) -> float:
    """What the fake model scores `DOCS[index]`."""
    return next(p for marker, p in SCORES.items() if marker in DOCS[index])


async def _post(server: RunningServer, path: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.http_port}") as http:
        return await http.post(path, json=body)


async def test_by_default_the_answer_is_the_models_order_and_scores(
    http_server: RunningServer,
) -> None:
    """As Cohere, Jina and TEI answer: sorted by the model's score, `relevance_score` that
    score, whatever retrieval rank a document came with; the answer says which blend."""
    response = await _post(
        http_server, "/v2/rerank", {"query": "what do cats eat?", "documents": DOCS}
    )
    answer = response.json()
    results = answer["results"]
    assert [r["index"] for r in results] == [2, 3, 1, 0]
    for r in results:
        assert r["relevance_score"] == r["reranker_score"]
        # (The fake's P(yes) goes through a logprob: within a rounding of what it was told.)
        assert r["relevance_score"] == pytest.approx(_said(r["index"]), abs=1e-4)
    assert answer["meta"]["blend_strategy"] == "rerank_only"
    assert response.headers[BLEND_HEADER] == "rerank_only"


@pytest.mark.parametrize("blend", ["position_aware", "linear", "adaptive", "profile"])
async def test_a_blend_asked_for_gives_its_blended_score_and_says_so(
    http_server: RunningServer, blend: str
) -> None:
    """A request that names a blend is ordered by it, `relevance_score` the blended score
    the results are sorted by, `reranker_score` still the model's own."""
    body: dict[str, Any] = {
        "query": "what do cats eat?",
        "documents": DOCS,
        "blend_strategy": blend,
    }
    response = await _post(http_server, "/v2/rerank", body)
    answer = response.json()
    relevance = [r["relevance_score"] for r in answer["results"]]
    assert relevance == sorted(relevance, reverse=True)
    assert answer["meta"]["blend_strategy"] in (blend, "adaptive")  # profile: none fits the fake
    assert response.headers[BLEND_HEADER] == answer["meta"]["blend_strategy"]
    for r in answer["results"]:
        assert r["reranker_score"] == pytest.approx(_said(r["index"]), abs=1e-4)


async def test_an_operator_may_make_a_blend_the_json_default(
    start_server: StartServer, fake_llama: FakeLlamaServer
) -> None:
    fake_llama.scores = dict(SCORES)
    server = await start_server(http_port=free_port(), http_blend_strategy="position_aware")
    response = await _post(server, "/rerank", {"query": "what do cats eat?", "texts": DOCS})
    assert response.headers[BLEND_HEADER] == "position_aware"
    # position_aware protects retrieval rank 1 against a model that scores it 0.02.
    assert response.json()[0]["index"] == 0


async def test_failed_pairs_change_no_other_documents_score_or_place(
    http_server: RunningServer, fake_llama: FakeLlamaServer
) -> None:
    """40% of pairs failing, in every shape: the scored documents come first, sorted, each
    with its own score; the failed follow at 0 in retrieval order; a threshold keeps
    exactly what the model scored at or above it; the answer says it is partial."""
    rng = random.Random(3)
    docs = [f"passage {i} on subject {i}" for i in range(50)]
    failing = set(rng.sample(range(50), 20))
    fake_llama.scores = {f"passage {i} on": round(rng.uniform(0.01, 0.99), 2) for i in range(50)}
    fake_llama.failing_markers = tuple(f"passage {i} on" for i in failing)
    fake_llama.mode_for_marked = HTTP_500
    for path, body, score in (
        ("/v2/rerank", {"query": "q", "documents": docs}, "relevance_score"),
        ("/v1/rerank", {"query": "q", "documents": docs, "top_n": 40}, "relevance_score"),
        ("/rerank", {"query": "q", "texts": docs}, "score"),
    ):
        response = await _post(http_server, path, body)
        assert response.status_code == 200, response.text
        assert response.headers[DEGRADED_HEADER] == "partial"
        results = response.json() if path == "/rerank" else response.json()["results"]
        scored = [r for r in results if r["index"] not in failing]
        assert results[: len(scored)] == scored, "a failed document came before a scored one"
        expected = sorted(
            (i for i in range(50) if i not in failing),
            key=lambda i: -fake_llama.scores[f"passage {i} on"],
        )
        assert [r["index"] for r in scored] == expected[: len(scored)]
        for r in scored:
            assert r[score] == pytest.approx(
                fake_llama.scores[f"passage {r['index']} on"], abs=1e-4
            )
        unscored = results[len(scored) :]
        assert [r["index"] for r in unscored] == sorted(failing)[: len(unscored)]
        assert all(r[score] == 0.0 for r in unscored)
        # Thresholds between the model's scores (which are whole hundredths).
        for t in (0.255, 0.505, 0.905):
            kept = {r["index"] for r in results if r[score] >= t}
            said = {i for i in expected if fake_llama.scores[f"passage {i} on"] >= t}
            assert (
                kept == said
                if path != "/v1/rerank"
                else kept == said & {r["index"] for r in results}
            )


async def test_a_capped_and_partial_answer_says_both(
    http_server: RunningServer, fake_llama: FakeLlamaServer
) -> None:
    fake_llama.failing_markers = ("Weather",)
    fake_llama.mode_for_marked = HTTP_500
    docs = [*DOCS, "Dogs eat anything.", "Parrots eat seeds."]
    response = await _post(
        http_server, "/v2/rerank", {"query": "cats", "documents": docs, "max_candidates": 4}
    )
    meta = response.json()["meta"]
    assert response.headers[DEGRADED_HEADER] == "partial, capped"
    assert meta["degraded"]["code"] == "partial"
    assert [d["code"] for d in meta["degraded_reasons"]] == ["partial", "capped"]
    assert "1 of 4 pairs failed" in meta["degraded_reasons"][0]["message"]
    assert "2 of 6 candidates were not scored" in meta["degraded_reasons"][1]["message"]


async def test_an_answer_the_model_did_not_score_says_so_in_every_shape(
    http_server: RunningServer, fake_llama: FakeLlamaServer
) -> None:
    """A failing backend: relevance 0 everywhere (a threshold drops them all, rather than
    keeping the retrieval order's first), and the degraded reason in a header that TEI's
    bare list has no other place for; the order is the retrieval order."""
    fake_llama.mode = HTTP_500
    cohere = await _post(http_server, "/v1/rerank", {"query": "q", "documents": DOCS})
    tei = await _post(http_server, "/rerank", {"query": "q", "texts": DOCS})
    for response in (cohere, tei):
        assert response.status_code == 200
    # (The failures eject the backend, so the second request is told it is unavailable.)
    assert cohere.headers[DEGRADED_HEADER] == "backend_error"
    assert tei.headers[DEGRADED_HEADER] == "backend_unavailable"
    assert cohere.json()["meta"]["reranked"] is False
    assert [(r["index"], r["relevance_score"]) for r in cohere.json()["results"]] == [
        (i, 0.0) for i in range(len(DOCS))
    ]
    assert [(r["index"], r["score"]) for r in tei.json()] == [(i, 0.0) for i in range(len(DOCS))]


async def test_a_reranked_answer_carries_no_degraded_header(http_server: RunningServer) -> None:
    response = await _post(http_server, "/v2/rerank", {"query": "q", "documents": DOCS})
    assert DEGRADED_HEADER not in response.headers


async def test_tei_scores_are_sorted_with_or_without_raw_scores(http_server: RunningServer) -> None:
    """Haystack's TEI ranker keeps the first results by score: they must be sorted."""
    for raw in (False, True):
        answer = (
            await _post(
                http_server,
                "/rerank",
                {"query": "what do cats eat?", "texts": DOCS, "raw_scores": raw},
            )
        ).json()
        scores = [r["score"] for r in answer]
        assert scores == sorted(scores, reverse=True)
        assert answer[0]["index"] == 2 and answer[0]["score"] == pytest.approx(0.92)


@pytest.mark.parametrize("return_documents", [True, None, False])
async def test_rerank_at_the_root_takes_infinity_and_vllm_bodies(
    http_server: RunningServer, return_documents: bool | None
) -> None:
    """LiteLLM's `infinity/` and `hosted_vllm/` post this very body to `/rerank` and parse
    `document` differently (a string, `{text}`): the answer leaves it out, which both
    read. vLLM's clients send nulls for options they leave alone."""
    response = await _post(
        http_server,
        "/rerank",
        {
            "model": "rerank",
            "query": "what do cats eat?",
            "documents": DOCS,
            "return_documents": return_documents,
            "top_n": None,
        },
    )
    assert response.status_code == 200, response.text
    answer = response.json()
    assert [r["index"] for r in answer["results"]][:2] == [2, 3]
    assert all("document" not in r for r in answer["results"])


async def test_one_or_two_documents_are_scored(http_server: RunningServer) -> None:
    for docs in (DOCS[2:3], DOCS[:2]):
        answer = (
            await _post(http_server, "/v2/rerank", {"query": "cats", "documents": docs})
        ).json()
        assert answer["meta"]["reranked"] is True and answer["meta"]["scored"] == len(docs)
        assert all("reranker_score" in r for r in answer["results"])


async def test_documents_past_max_candidates_are_said_to_be_unscored(
    http_server: RunningServer,
) -> None:
    docs = [f"Document {i} about cats." for i in range(60)]
    response = await _post(
        http_server, "/v2/rerank", {"query": "cats", "documents": docs, "max_candidates": 40}
    )
    answer = response.json()
    assert response.headers[DEGRADED_HEADER] == "capped"
    assert answer["meta"]["degraded"]["code"] == "capped"
    assert "20 of 60 candidates were not scored" in answer["meta"]["degraded"]["message"]
    unscored = [r for r in answer["results"] if "reranker_score" not in r]
    assert sorted(r["index"] for r in unscored) == list(range(40, 60))
    assert all(r["relevance_score"] == 0.0 for r in unscored)


async def test_every_document_is_scored_by_default(http_server: RunningServer) -> None:
    """Up to the per-request limit (`--max-request-candidates`, 100)."""
    docs = [f"Document {i} about cats." for i in range(100)]
    answer = (await _post(http_server, "/v2/rerank", {"query": "c", "documents": docs})).json()
    assert answer["meta"]["scored"] == 100 and "degraded" not in answer["meta"]


async def test_the_model_has_one_name_everywhere(
    http_server: RunningServer, fake_llama: FakeLlamaServer
) -> None:
    await _post(http_server, "/v2/rerank", {"query": "q", "documents": DOCS})
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_server.http_port}") as http:
        models = (await http.get("/v1/models")).json()
        health = (await http.get("/health")).json()
    meta = (await _post(http_server, "/v2/rerank", {"query": "q", "documents": DOCS})).json()[
        "meta"
    ]
    assert models["data"][0]["id"] == meta["model"] == health["model"] == fake_llama.model


async def test_docs_are_served_without_the_internet(start_server: StartServer) -> None:
    """Swagger UI's script and style come from the server itself, open like `/docs`."""
    server = await start_server(http_port=free_port(), auth_tokens="t" * 20)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.http_port}") as http:
        page = await http.get("/docs")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert "://" not in page.text.replace("http://127.0.0.1", "")
        for asset in ("swagger-ui-bundle.js", "swagger-ui.css"):
            assert f"/docs/assets/{asset}" in page.text
            got = await http.get(f"/docs/assets/{asset}")
            assert got.status_code == 200 and len(got.content) > 100_000
