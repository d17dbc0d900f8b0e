"""Logs: one canonical line per RPC, and never the query or document text."""

from __future__ import annotations

import asyncio
import json

import pytest
from rerank_client import AsyncRerankClient, InvalidRequestError, ServerBusyError

from tests.conftest import StartServer, client_of
from tests.fakes.llama import HTTP_500, FakeLlamaServer
from tests.waiting import eventually

CANARY = "CANARY-7f3a"


def _events(out: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


async def test_canonical_line_has_counts_and_no_text(
    client: AsyncRerankClient, fake_llama: FakeLlamaServer, capsys: pytest.CaptureFixture[str]
) -> None:
    docs = [f"{CANARY} document {i}" for i in range(4)]
    await client.rerank(
        f"{CANARY} query", docs, request_id="rid-1", instruction=f"{CANARY} instruction"
    )
    fake_llama.mode = HTTP_500
    await client.rerank(f"{CANARY} query", docs, request_id="rid-2")
    with pytest.raises(InvalidRequestError):
        await client.rerank(f"{CANARY} query", [*docs, docs[0] * 20_000], request_id="rid-3")
    out = capsys.readouterr().out
    assert CANARY not in out
    rpc_lines = [e for e in _events(out) if e["event"] == "rpc"]
    by_id = {e["request_id"]: e for e in rpc_lines}
    assert by_id["rid-1"]["status"] == "OK" and by_id["rid-1"]["scored"] == 4
    assert by_id["rid-1"]["method"] == "/rerank.v1.Reranker/Rerank"
    assert by_id["rid-2"]["reranked"] is False and by_id["rid-2"]["degraded"] == "backend_error"
    assert by_id["rid-3"]["status"] == "INVALID_ARGUMENT"
    assert all(isinstance(e["total_ms"], float) for e in rpc_lines)


async def test_a_request_id_over_its_limit_is_neither_logged_nor_echoed(
    client: AsyncRerankClient, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused, as any field over its limit; before, the whole id went into the log line
    (10 MB of log for a 10 MB id) and back in a batch's error answer."""
    long_id = "R" * 100_000
    with pytest.raises(InvalidRequestError):
        await client.rerank("q", ["a", "b"], request_id=long_id)
    answers = [a async for a in client.rerank_many({long_id: ("q", ["a", "b"])})]
    out = capsys.readouterr().out
    assert "R" * 600 not in out
    refused = [e for e in _events(out) if e["event"] == "rpc"]
    assert [e["status"] for e in refused] == ["INVALID_ARGUMENT", "INVALID_ARGUMENT"]
    assert all(e["request_id"] == "" for e in refused)
    [(echoed, error)] = answers
    assert echoed == "" and isinstance(error, InvalidRequestError)


async def test_calls_that_end_without_an_answer_have_their_line_too(
    start_server: StartServer, fake_llama: FakeLlamaServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """A call its client cancels (unary or stream) and one shed by --max-concurrent-rpcs:
    each had no `rpc` line before (cancellation is not an Exception; shedding happens in
    the interceptor)."""
    server = await start_server(max_concurrent_rpcs=1)
    fake_llama.latency_s = 0.5
    docs = ["a", "b", "c"]
    async with client_of(server) as client:
        unary = asyncio.ensure_future(client.rerank("q", docs, request_id="cancelled-1"))
        assert await eventually(lambda: fake_llama.in_flight > 0, 5)
        with pytest.raises(ServerBusyError):
            await client.rerank("q", docs, request_id="shed-1")
        unary.cancel()

        async def read_all() -> None:
            async for _ in client.stream("q", docs, request_id="cancelled-2"):
                pass

        assert await eventually(lambda: fake_llama.in_flight == 0, 5)
        stream = asyncio.ensure_future(read_all())
        assert await eventually(lambda: fake_llama.in_flight > 0, 5)
        stream.cancel()
        await asyncio.sleep(0.3)
    lines = [e for e in _events(capsys.readouterr().out) if e["event"] == "rpc"]
    statuses = {e.get("request_id"): e["status"] for e in lines}
    assert statuses["cancelled-1"] == "CANCELLED"
    assert statuses["cancelled-2"] == "CANCELLED"
    assert [e["rpc"] for e in lines if e["status"] == "RESOURCE_EXHAUSTED"] == [
        "rerank.v1.Reranker/Rerank"
    ]
