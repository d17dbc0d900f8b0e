"""The model's clear favourite comes first at any list length, on both edges, under the
default blends and every request-wide one (docs/blending.md, "Evidence at any depth")."""

from __future__ import annotations

import httpx
import pytest

from rerank_server.managed.child_process import free_port
from rerank_server.server import RunningServer
from tests.conftest import StartServer, client_of
from tests.fakes.llama import FakeLlamaServer

# The fake model scores the one on-topic document 0.43 and every other 0.02, as a sharp
# reranker does a list with one good answer.
NEEDLE, ON_TOPIC, OFF_TOPIC = "felines hunting mice", 0.43, 0.02


def _documents(n: int) -> list[str]:
    """`n` documents, retrieval's order, the needle last."""
    return [f"Report {i} on the harbour's shipping schedule." for i in range(n - 1)] + [
        f"Cats are {NEEDLE} at night."
    ]


@pytest.fixture
async def needle_server(start_server: StartServer, fake_llama: FakeLlamaServer) -> RunningServer:
    fake_llama.scores = {NEEDLE: ON_TOPIC}
    fake_llama.default_score = OFF_TOPIC
    return await start_server(http_port=free_port(), concurrency=8)


@pytest.mark.parametrize("n", [20, 60, 100])
async def test_the_needle_at_the_end_comes_first_under_the_defaults(
    needle_server: RunningServer, n: int
) -> None:
    docs = _documents(n)
    async with client_of(needle_server) as client:
        answer = await client.rerank("what do cats eat?", docs, top_k=3)
    assert answer.reranked and answer.results[0].id == str(n - 1)
    assert answer.summary.blend_strategy == "adaptive"  # `profile`: none fits the fake
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{needle_server.http_port}") as http:
        body = {"model": "rerank-v3.5", "query": "what do cats eat?", "documents": docs}
        cohere = (await http.post("/v2/rerank", json={**body, "top_n": 3})).json()
        tei = (await http.post("/rerank", json={"query": "q", "texts": docs})).json()
    assert cohere["results"][0]["index"] == n - 1
    assert cohere["results"][0]["relevance_score"] == pytest.approx(ON_TOPIC, abs=1e-4)
    assert tei[0]["index"] == n - 1


@pytest.mark.parametrize("blend", ["adaptive", "profile"])
@pytest.mark.parametrize("n", [60, 100])
async def test_every_request_wide_blend_lifts_the_needle(
    needle_server: RunningServer, blend: str, n: int
) -> None:
    docs = _documents(n)
    async with client_of(needle_server) as client:
        answer = await client.rerank("q", docs, top_k=1, blend_strategy=blend)
    assert answer.results[0].id == str(n - 1)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{needle_server.http_port}") as http:
        body = {"query": "q", "documents": docs, "top_n": 1, "blend_strategy": blend}
        assert (await http.post("/v1/rerank", json=body)).json()["results"][0]["index"] == n - 1


async def test_a_model_that_cannot_tell_documents_apart_leaves_the_retrieval_order(
    needle_server: RunningServer, fake_llama: FakeLlamaServer
) -> None:
    """Near-equal scores, however many, give the model no weight under the default."""
    fake_llama.scores = {f"Report {i} on": 0.50 + (i * 37 % 7) / 100 for i in range(100)}
    fake_llama.default_score = 0.53
    docs = _documents(100)
    async with client_of(needle_server) as client:
        answer = await client.rerank("q", docs)
    assert [r.id for r in answer.results] == [str(i) for i in range(100)]
