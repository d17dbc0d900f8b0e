"""What a JSON client reads as relevance, and the shapes each client parses, over real HTTP
on loopback (docs/http.md): scores a client can threshold, no silent caps, `/rerank` for
TEI's, Infinity's and vLLM's bodies, one model name, and `/docs` without a CDN."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from rerank_server.http_api.app import DEGRADED_HEADER
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


async def _post(server: RunningServer, path: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.http_port}") as http:
        return await http.post(path, json=body)


@pytest.mark.parametrize("blend", [None, "position_aware", "linear", "adaptive"])
async def test_an_irrelevant_document_never_scores_high_for_its_rank(
    http_server: RunningServer, blend: str | None
) -> None:
    """Whatever the blend puts first, no document's relevance passes the model's own
    score of it, and the results are sorted by relevance, in the server's order."""
    body: dict[str, Any] = {"query": "what do cats eat?", "documents": DOCS}
    if blend:
        body["blend_strategy"] = blend
    answer = (await _post(http_server, "/v2/rerank", body)).json()
    results = answer["results"]
    relevance = [r["relevance_score"] for r in results]
    assert relevance == sorted(relevance, reverse=True)
    for r in results:
        assert r["relevance_score"] <= r["reranker_score"]
    by_index = {r["index"]: r["relevance_score"] for r in results}
    # (The fake's P(yes) goes through a logprob: within a rounding of what it was told.)
    assert by_index[0] <= SCORES["stock"] + 1e-4 and by_index[1] <= SCORES["Weather"] + 1e-4


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
