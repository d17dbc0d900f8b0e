"""Several models in one server, each over its own fake backend on loopback: requests
are routed by `model` on both edges (names and aliases), an unknown name is answered
404 / NOT_FOUND with the served names unless a default is named, `/v1/models` and
`/health` list every model, and a model whose backend is down degrades its own requests
only."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import structlog
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from rerank_client import ModelNotFoundError

from rerank_server.managed.child_process import free_port
from rerank_server.observability.telemetry import Telemetry
from rerank_server.server import RunningServer, build_server
from rerank_server.settings import Settings
from tests.conftest import StartServer, client_of
from tests.fakes.llama import FakeLlamaServer

QUERY = "what do cats eat?"
DOCS = [f"document {i}" for i in range(60)] + ["cats eat meat"]


@pytest.fixture
def second_llama() -> Iterator[FakeLlamaServer]:
    fake = FakeLlamaServer(model="second.gguf", scores={"cats": 0.99}).start()
    yield fake
    fake.stop()


def models_file(tmp_path: Path, default: str = "", **models: dict[str, Any]) -> str:
    lines = [f'default = "{default}"'] if default else []
    for name, table in models.items():
        lines.append(f'[models."{name}"]')
        lines += [f"{key} = {value!r}".replace("'", '"') for key, value in table.items()]
    path = tmp_path / "models.toml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


StartTwo = Callable[..., Awaitable[RunningServer]]


@pytest.fixture
def start_two(
    start_server: StartServer,
    fake_llama: FakeLlamaServer,
    second_llama: FakeLlamaServer,
    tmp_path: Path,
) -> StartTwo:
    """Starts a server of two models: "english" (alias "rerank-english-v3.0") on
    `fake_llama`, "BAAI/bge-reranker-v2-m3" (concurrency 2) on `second_llama`."""

    async def start(default: str = "") -> RunningServer:
        path = models_file(
            tmp_path,
            default,
            english={"source": fake_llama.url, "aliases": ["rerank-english-v3.0"]},
            **{"BAAI/bge-reranker-v2-m3": {"source": second_llama.url, "concurrency": 2}},
        )
        return await start_server(models_file=path, http_port=free_port())

    return start


async def post(server: RunningServer, **body: Any) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as http:
        return await http.post(
            f"http://127.0.0.1:{server.http_port}/v1/rerank",
            json={"query": QUERY, "documents": DOCS, **body},
        )


async def test_json_requests_are_routed_by_name_and_alias(
    start_two: StartTwo, fake_llama: FakeLlamaServer, second_llama: FakeLlamaServer
) -> None:
    server = await start_two()
    for name, served in (
        ("english", "english"),
        ("rerank-english-v3.0", "english"),
        ("BAAI/bge-reranker-v2-m3", "BAAI/bge-reranker-v2-m3"),
        (None, "english"),  # no name: the first model
    ):
        answer = await post(server, **({"model": name} if name else {}))
        assert answer.status_code == 200, answer.text
        assert answer.json()["meta"]["model"] == served, name
    # Each model's pairs went to its own backend (and were cached apart: each once).
    assert len(fake_llama.requests) == len(second_llama.requests) == len(DOCS)
    second = (await post(server, model="BAAI/bge-reranker-v2-m3")).json()
    assert second["results"][0]["index"] == len(DOCS) - 1  # its backend's favourite


async def test_an_unknown_name_is_refused_with_the_served_names_on_both_edges(
    start_two: StartTwo,
) -> None:
    server = await start_two()
    with structlog.testing.capture_logs() as logged:
        answer = await post(server, model="rerank-v3.5")
    assert answer.status_code == 404
    message = answer.json()["message"]
    assert "'rerank-v3.5'" in message and "english, BAAI/bge-reranker-v2-m3" in message
    assert [e["status"] for e in logged if e.get("event") == "rpc"] == ["404"]
    async with client_of(server) as client:
        with pytest.raises(ModelNotFoundError, match="served: english, BAAI/bge-reranker-v2-m3"):
            await client.rerank(QUERY, DOCS, model="rerank-v3.5")
        answer = await client.rerank(QUERY, DOCS, model="BAAI/bge-reranker-v2-m3")
        assert answer.summary.model == "BAAI/bge-reranker-v2-m3"
        assert answer.results[0].index == len(DOCS) - 1
        queries = {"a": (QUERY, DOCS), "b": (QUERY, DOCS[:5])}
        answers = dict([a async for a in client.rerank_many(queries, model="nope")])
        assert all(isinstance(a, ModelNotFoundError) for a in answers.values()), answers


async def test_a_named_default_answers_unknown_names(
    start_two: StartTwo,
) -> None:
    server = await start_two(default="BAAI/bge-reranker-v2-m3")
    answer = await post(server, model="rerank-v3.5")
    assert answer.status_code == 200
    assert answer.json()["meta"]["model"] == "BAAI/bge-reranker-v2-m3"
    async with httpx.AsyncClient() as http:
        listed = (await http.get(f"http://127.0.0.1:{server.http_port}/v1/models")).json()
    assert [m["id"] for m in listed["data"]] == ["BAAI/bge-reranker-v2-m3", "english"]
    assert listed["data"][1]["aliases"] == ["rerank-english-v3.0"]


async def test_with_one_model_any_name_is_accepted(start_server: StartServer) -> None:
    server = await start_server(http_port=free_port())
    answer = await post(server, model="rerank-v3.5")
    assert answer.status_code == 200 and answer.json()["meta"]["model"] == "fake-reranker.gguf"
    async with client_of(server) as client:
        assert (await client.rerank(QUERY, DOCS[:3], model="anything")).reranked


async def test_a_model_whose_backend_is_down_degrades_only_its_own_requests(
    start_server: StartServer,
    fake_llama: FakeLlamaServer,
    tmp_path: Path,
) -> None:
    """Its requests answer in retrieval order, saying why; the other model's are
    reranked; `/health` names each model's state and stays 200 while the default is up."""
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    path = models_file(
        tmp_path, english={"source": fake_llama.url}, gone={"source": dead, "timeout-ms": 2000}
    )
    server = await start_server(models_file=path, http_port=free_port(), health_interval_s=0.1)
    answers = await asyncio.gather(*(post(server, model=name) for name in ["gone", "english"] * 10))
    gone, english = answers[0::2], answers[1::2]
    for answer in gone:
        assert answer.status_code == 200
        assert answer.headers["X-Rerank-Degraded"] == "backend_unavailable"
        assert answer.json()["meta"]["reranked"] is False
        assert [r["index"] for r in answer.json()["results"][:3]] == [0, 1, 2]
    assert all(a.json()["meta"]["reranked"] for a in english)
    async with httpx.AsyncClient() as http:
        for _ in range(50):
            health = await http.get(f"http://127.0.0.1:{server.http_port}/health")
            if health.json().get("models", {}).get("gone") == "down":
                break
            await asyncio.sleep(0.1)
    assert health.status_code == 200
    assert health.json()["models"] == {"english": "up", "gone": "down"}


async def test_each_model_logs_and_counts_under_its_name(
    start_two: StartTwo,
) -> None:
    server = await start_two()
    with structlog.testing.capture_logs() as logged:
        await post(server, model="rerank-english-v3.0")
        await post(server, model="BAAI/bge-reranker-v2-m3")
    models = [e["model"] for e in logged if e.get("event") == "rpc"]
    assert models == ["english", "BAAI/bge-reranker-v2-m3"]
    assert server.stacks[1].settings.concurrency == 2  # its own setting from the file


async def test_spans_carry_the_served_model(
    fake_llama: FakeLlamaServer, second_llama: FakeLlamaServer, tmp_path: Path
) -> None:
    exporter = InMemorySpanExporter()
    path = models_file(
        tmp_path, english={"source": fake_llama.url}, second={"source": second_llama.url}
    )
    settings = Settings(port=0, http_port=0, probe=False, metrics=False, models_file=path)
    telemetry = Telemetry.create(settings, span_processor=SimpleSpanProcessor(exporter), environ={})
    server = await build_server(settings, telemetry=telemetry)
    try:
        async with client_of(server) as client:
            await client.rerank(QUERY, DOCS[:4], model="second")
    finally:
        await server.stop(grace=0)
    models = {s.attributes.get("rerank.model") for s in exporter.get_finished_spans()}
    assert "second" in models and "english" not in models
