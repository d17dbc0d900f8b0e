"""Bad requests get INVALID_ARGUMENT with a message naming the field; nothing is scored."""

from __future__ import annotations

import pytest
from rerank_client import AsyncRerankClient, Candidate, InvalidRequestError

from tests.conftest import StartServer
from tests.fakes.llama import FakeLlamaServer


@pytest.mark.parametrize(("query", "candidates", "options", "field"), [
    ("", ["a"], {}, "query"),
    ("   ", ["a"], {}, "query"),
    ("q" * 5000, ["a"], {}, "query"),
    ("q", [Candidate(id="", text="x")], {}, "candidates[0].id"),
    ("q", [Candidate(id="x", text="a"), Candidate(id="x", text="b")], {}, "candidates[1].id"),
    ("q", [Candidate(id="x", text="a" * 40_000)], {}, "candidates[0].text"),
    ("q", [Candidate(id="x", text="a", title="t" * 40_000)], {}, "candidates[0].title"),
    ("q", [Candidate(id="x", text="a", retrieval_rank=0)], {}, "candidates[0].retrieval_rank"),
    ("q", [Candidate(id="x", text="a", retrieval_score=float("nan"))], {},
     "candidates[0].retrieval_score"),
    ("q", [f"d{i}" for i in range(101)], {}, "candidates"),
    ("q", ["a"], {"max_candidates": 0}, "options.max_candidates"),
    ("q", ["a"], {"max_candidates": 500}, "options.max_candidates"),
    ("q", ["a"], {"timeout_ms": 0}, "options.timeout_ms"),
    ("q", ["a"], {"max_chunk_chars": 10}, "options.max_chunk_chars"),
    ("q", ["a"], {"instruction": " "}, "instruction"),
    ("q", ["a"], {"request_id": "r" * 600}, "request_id"),
])
async def test_invalid_request_names_the_field(
        client: AsyncRerankClient, fake_llama: FakeLlamaServer, query: str,
        candidates: list[object], options: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        await client.rerank(query, candidates, **options)  # type: ignore[arg-type]
    assert info.value.code == "INVALID_ARGUMENT"
    assert info.value.message.startswith(f"{field}: ")
    assert fake_llama.requests == []


async def test_error_message_never_quotes_text(client: AsyncRerankClient) -> None:
    secret = "SECRET-CANARY"
    with pytest.raises(InvalidRequestError) as info:
        await client.rerank(secret * 500, [secret])
    assert secret not in info.value.message


async def test_oversized_message_is_rejected_by_transport(start_server: StartServer) -> None:
    server = await start_server(max_message_bytes=4096)
    async with AsyncRerankClient(f"127.0.0.1:{server.port}") as client:
        with pytest.raises(Exception) as info:
            await client.rerank("q", ["x" * 3000, "y" * 3000])
    assert getattr(info.value, "code", "") == "RESOURCE_EXHAUSTED"
