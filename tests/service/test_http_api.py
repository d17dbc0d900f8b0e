"""The JSON rerank API over real HTTP on loopback: the official Cohere SDK (v1 and v2
clients, unmodified), TEI's shape, tokens, errors, health, models, OpenAPI."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import cohere
import httpx
import pytest
from cohere.core.api_error import ApiError

from rerank_server.managed.llama_server import free_port
from rerank_server.server import RunningServer
from tests.conftest import StartServer
from tests.fakes.llama import FakeLlamaServer

TOKEN = "test-token-0123456789abcdef"
DOCS = ["Cats are obligate carnivores that eat meat.", "The stock market fell.",
        "Kittens need milk.", "Dogs eat almost anything."]


@pytest.fixture
async def http_server(start_server: StartServer, fake_llama: FakeLlamaServer,
                      ) -> RunningServer:
    fake_llama.scores = {"Cats": 0.95, "Kittens": 0.9, "stock": 0.01, "Dogs": 0.3}
    return await start_server(http_port=free_port(), auth_tokens=TOKEN,
                              blend_strategy="rerank_only")


def base_url(server: RunningServer) -> str:
    return f"http://127.0.0.1:{server.http_port}"


@contextlib.contextmanager
def sdk(kind: type[Any], server: RunningServer, token: str | None) -> Iterator[Any]:
    """An official Cohere client pointed at the server, its connections closed after."""
    with httpx.Client() as transport:
        yield kind(api_key=token or "", base_url=base_url(server), httpx_client=transport)


async def test_cohere_v1_client_reranks_unmodified(http_server: RunningServer) -> None:
    with sdk(cohere.Client, http_server, TOKEN) as co:
        answer = await asyncio.to_thread(co.rerank, model="rerank-english-v3.0",
                                         query="what do cats eat?", documents=DOCS, top_n=3,
                                         return_documents=True)
    assert [r.index for r in answer.results] == [0, 2, 3]
    scores = [r.relevance_score for r in answer.results]
    assert scores == sorted(scores, reverse=True)
    assert answer.results[0].document is not None
    assert answer.results[0].document.text == DOCS[0]
    assert answer.meta is not None and answer.meta.api_version is not None
    assert answer.meta.api_version.version == "1"


async def test_cohere_v2_client_reranks_unmodified(http_server: RunningServer) -> None:
    with sdk(cohere.ClientV2, http_server, TOKEN) as co:
        answer = await asyncio.to_thread(co.rerank, model="rerank-v3.5",
                                         query="what do cats eat?", documents=DOCS)
    assert [r.index for r in answer.results] == [0, 2, 3, 1]
    extra: Any = answer.meta
    assert extra.reranked is True and extra.backend == "chat"


@pytest.mark.parametrize("token", [None, "wrong-token-0123456789abc"])
async def test_cohere_client_without_a_valid_token_is_refused(
        http_server: RunningServer, fake_llama: FakeLlamaServer, token: str | None) -> None:
    with sdk(cohere.ClientV2, http_server, token) as co, pytest.raises(ApiError) as info:
        await asyncio.to_thread(co.rerank, model="m", query="q", documents=DOCS)
    assert info.value.status_code == 401
    assert fake_llama.requests == []


async def test_tei_shape_and_our_extras(http_server: RunningServer) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(base_url=base_url(http_server), headers=headers) as http:
        tei = (await http.post("/rerank", json={"query": "cats", "texts": DOCS,
                                                "return_text": True})).json()
        extras = (await http.post("/v1/rerank", json={
            "query": "cats", "blend_strategy": "position_aware", "request_id": "r-1",
            "documents": [{"text": d, "id": f"doc-{i}", "retrieval_rank": 4 - i}
                          for i, d in enumerate(DOCS)]})).json()
    assert [r["index"] for r in tei] == [0, 2, 3, 1]
    assert tei[0]["text"] == DOCS[0] and tei[0]["score"] >= tei[1]["score"]
    assert extras["id"] == "r-1" and extras["meta"]["blend_strategy"] == "position_aware"
    assert extras["results"][0]["id"].startswith("doc-")
    assert all(r["reranker_score"] is not None for r in extras["results"])


@pytest.mark.parametrize(("body", "status", "message"), [
    ({"query": "", "documents": ["a"]}, 422, "query: must not be empty"),
    ({"query": "q", "documents": [{"id": "x", "text": "a"}, {"id": "x", "text": "b"}]},
     422, "documents[1].id: duplicate of documents[0].id"),
    ({"query": "q", "documents": [1]}, 422, "documents[0]"),
    ({"query": "q"}, 422, "documents: Field required"),
    ({"query": "q", "documents": ["a"], "blend_strategy": "magic"}, 422, "blend_strategy"),
])
async def test_errors_are_json_and_name_the_field(http_server: RunningServer,
                                                  body: dict[str, Any], status: int,
                                                  message: str) -> None:
    async with httpx.AsyncClient(base_url=base_url(http_server)) as http:
        reply = await http.post("/v1/rerank", json=body,
                                headers={"Authorization": f"Bearer {TOKEN}"})
    assert reply.status_code == status
    assert reply.json()["message"].startswith(message), reply.json()


async def test_health_is_open_models_need_a_token_openapi_lists_the_routes(
        http_server: RunningServer) -> None:
    async with httpx.AsyncClient(base_url=base_url(http_server)) as http:
        for _ in range(50):  # the backend monitor's first check
            health = await http.get("/health")
            if health.status_code == 200:
                break
            await asyncio.sleep(0.05)
        refused = await http.get("/v1/models")
        models = await http.get("/v1/models", headers={"Authorization": f"Bearer {TOKEN}"})
        spec = (await http.get("/openapi.json")).json()
    assert health.status_code == 200 and health.json()["backend"] == "up"
    assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
    assert models.json()["data"][0]["id"] == "fake-reranker.gguf"
    assert {"/v1/rerank", "/v2/rerank", "/rerank", "/health", "/v1/models"} <= set(
        spec["paths"])


async def test_health_says_503_while_the_backend_is_down(
        start_server: StartServer, fake_llama: FakeLlamaServer) -> None:
    fake_llama.kill()
    server = await start_server(http_port=free_port(), health_interval_s=0.1)
    async with httpx.AsyncClient(base_url=base_url(server)) as http:
        # The monitor notices within a few polls; a loaded machine (CI) may take seconds.
        deadline = time.monotonic() + 10
        while True:
            health = await http.get("/health")
            if health.json()["backend"] == "down" or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
    assert health.status_code == 503 and health.json()["status"] == "unavailable"


async def test_token_and_size_are_checked_before_the_body_is_read(
        start_server: StartServer) -> None:
    server = await start_server(http_port=free_port(), auth_tokens=TOKEN,
                                max_message_bytes=64 * 1024)
    big = b'{"query": "q", "documents": ["' + b"x" * 200_000 + b'"]}'
    async with httpx.AsyncClient(base_url=base_url(server)) as http:
        anonymous = await http.post("/v1/rerank", content=big,
                                    headers={"Content-Type": "application/json"})
        small_anonymous = await http.post("/v1/rerank", json={"query": "q",
                                                              "documents": DOCS})
        too_big = await http.post("/v1/rerank", content=big, headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
    assert anonymous.status_code in (401, 413)  # either way, refused from the headers
    assert small_anonymous.status_code == 401
    assert too_big.status_code == 413


@pytest.mark.parametrize(("body", "message"), [
    ('{"query": "q", "documents": ["a", "b"], "max_candidates": 500}',
     "max_candidates: must be between 1 and 100"),
    ('{"query": "q", "documents": ["ok", "bad \\ud800 text"]}',  # valid JSON, not UTF-8
     "documents[1].text: is not valid Unicode"),
])
async def test_http_errors_name_the_field_as_the_client_wrote_it(
        http_server: RunningServer, body: str, message: str) -> None:
    async with httpx.AsyncClient(base_url=base_url(http_server)) as http:
        reply = await http.post("/v1/rerank", content=body, headers={
            "Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    assert reply.status_code == 422
    assert reply.json()["message"].startswith(message), reply.json()
