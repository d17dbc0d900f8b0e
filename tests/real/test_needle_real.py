"""The needle case with a real model (MiniLM-L6 through llama-server) on every shared
collection at 20, 50 and 100 candidates: the default blend lifts the relevant document
into the top 3 about as often as the model alone does, and on a script the model cannot
read it keeps the retrieval order (docs/blending.md, "Evidence at any list length")."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from rerank_client import AsyncRerankClient, Candidate

from rerank_server.evaluation import beir
from rerank_server.evaluation.first_stage import bm25_top
from rerank_server.evaluation.needle import Needle, needles
from rerank_server.server import RunningServer
from tests.conftest import StartServer, client_of
from tests.real.conftest import RealLlama

pytestmark = pytest.mark.real_backend

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
QUERIES = 20  # the first needle requests of each collection (sorted query ids)
SIZES = (20, 50, 100)


@pytest.fixture(scope="module")
def cases() -> dict[str, dict[int, list[Needle]]]:
    """Each collection's needle requests at each size, from BM25's top 200."""
    if not DATA.is_dir():
        pytest.fail(f"the shared collections are missing: {DATA} (shared/ beside the clone)")
    out: dict[str, dict[int, list[Needle]]] = {}
    for name in ("trec_dl19_passage_subset", "vaswani_npl", "arcd_arabic"):
        data = beir.load(DATA / name)
        hits = bm25_top(data, 200)
        out[name] = {size: needles(data, hits, size)[:QUERIES] for size in SIZES}
    return out


@pytest.fixture
async def minilm(start_server: StartServer, real_embedding: RealLlama) -> RunningServer:
    running = await start_server(
        backend="embedding", backend_url=real_embedding.url, concurrency=2, max_batch=32
    )
    await asyncio.wait_for(running.monitor.ready.wait(), 30)  # its profile is matched by name
    return running


async def _top3(client: AsyncRerankClient, query: str, case: Needle, blend: str) -> list[str]:
    answer = await client.rerank(
        query,
        [Candidate(id=d.id, text=d.text, title=d.title or None) for d in case.documents],
        blend_strategy=blend,
        max_candidates=len(case.documents),
        top_k=3,
        timeout=120,
    )
    return [r.id for r in answer.results]


@pytest.mark.parametrize("collection", ["trec_dl19_passage_subset", "vaswani_npl"])
async def test_the_default_lifts_the_needle_about_as_often_as_the_model(
    minilm: RunningServer, cases: dict[str, dict[int, list[Needle]]], collection: str
) -> None:
    queries = beir.load(DATA / collection).queries
    async with client_of(minilm) as client:
        for size in SIZES:
            found = {"profile": 0, "rerank_only": 0}
            for case in cases[collection][size]:
                for blend in found:
                    top = await _top3(client, queries[case.qid], case, blend)
                    found[blend] += case.needle in top
            n = len(cases[collection][size])
            print(f"{collection} at {size}: {n} needle requests, top 3: {found}")
            assert n >= 10
            assert found["profile"] >= 0.9 * found["rerank_only"], (size, found)


async def test_on_a_script_the_model_cannot_read_the_default_keeps_retrieval_order(
    minilm: RunningServer, cases: dict[str, dict[int, list[Needle]]]
) -> None:
    """MiniLM-L6 is an English model: on Arabic its shipped profile gives it no weight,
    at every list length, and sends no pair (its needle rate of 0 is on purpose:
    docs/blending.md, "Scripts")."""
    queries = beir.load(DATA / "arcd_arabic").queries
    async with client_of(minilm) as client:
        for size in SIZES:
            for case in cases["arcd_arabic"][size][:5]:
                answer = await client.rerank(
                    queries[case.qid],
                    [Candidate(id=d.id, text=d.text) for d in case.documents],
                    max_candidates=size,
                )
                assert [r.id for r in answer.results] == [d.id for d in case.documents]
                assert answer.summary.degraded_code == "no_reranker_weight"
