"""Backend trouble degrades an answer, never fails it: retrieval order plus the reason."""

from __future__ import annotations

import socket

import pytest
from rerank_client import AsyncRerankClient, Candidate

from tests.conftest import StartServer, client_of
from tests.fakes import llama
from tests.fakes.llama import FakeLlamaServer

# Retrieval order is a, b, c, d, e (input order).
DOCS = [Candidate(id=x, text=f"document {x}") for x in "abcde"]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _rerank(start_server: StartServer, **settings: object) -> object:
    server = await start_server(**settings)
    async with client_of(server) as client:
        return await client.rerank("q", DOCS, blend_strategy="rerank_only")


def _assert_retrieval_order(answer: object, code: str) -> None:
    assert [r.id for r in answer.results] == list("abcde")  # type: ignore[attr-defined]
    assert not answer.reranked  # type: ignore[attr-defined]
    assert answer.summary.degraded_code == code  # type: ignore[attr-defined]
    assert all(r.reranker_score is None for r in answer.results)  # type: ignore[attr-defined]


async def test_stopped_backend_answers_in_retrieval_order(start_server: StartServer) -> None:
    answer = await _rerank(start_server, backend_url=f"http://127.0.0.1:{_closed_port()}")
    _assert_retrieval_order(answer, "backend_unavailable")
    assert "all 5 pairs failed" in answer.summary.degraded_message  # type: ignore[attr-defined]
    assert answer.summary.failed == 5  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("mode", "code"),
    [
        (llama.HTTP_500, "backend_error"),
        (llama.NOT_JSON, "malformed_response"),
        (llama.NO_LOGPROBS, "malformed_response"),
        (llama.NO_YES_NO, "malformed_response"),
        (llama.DROP_CONNECTION, "backend_unavailable"),
    ],
)
async def test_every_pair_failing_degrades_with_reason(
    start_server: StartServer, fake_llama: FakeLlamaServer, mode: str, code: str
) -> None:
    fake_llama.mode = mode
    _assert_retrieval_order(await _rerank(start_server), code)


async def test_timeout_degrades_with_timeout_reason(
    start_server: StartServer, fake_llama: FakeLlamaServer
) -> None:
    fake_llama.latency_s = 1.0
    answer = await _rerank(start_server, timeout_ms=200)
    _assert_retrieval_order(answer, "timeout")
    assert answer.summary.total_ms < 900  # type: ignore[attr-defined]


async def test_some_pairs_failing_ranks_the_scored_ones(
    start_server: StartServer, fake_llama: FakeLlamaServer
) -> None:
    fake_llama.scores = {"document c": 0.9, "document e": 0.8, "document a": 0.1}
    fake_llama.failing_markers = ("document b", "document d")
    answer = await _rerank(start_server)
    assert answer.reranked  # type: ignore[attr-defined]
    assert answer.summary.degraded_code == "partial"  # type: ignore[attr-defined]
    assert (answer.summary.scored, answer.summary.failed) == (3, 2)  # type: ignore[attr-defined]
    # rerank_only: the reranker's order, then the failed pairs in retrieval order (they
    # have no score; standing in 1/rank put b at 0.5, above a's 0.1).
    assert [r.id for r in answer.results] == list("ceabd")  # type: ignore[attr-defined]
    assert [r.score for r in answer.results][3:] == [0.0, 0.0]  # type: ignore[attr-defined]


async def test_only_yes_token_uses_floor_for_no(
    start_server: StartServer, fake_llama: FakeLlamaServer
) -> None:
    fake_llama.mode = llama.ONLY_YES
    fake_llama.default_score = 0.5
    answer = await _rerank(start_server)
    assert answer.reranked  # type: ignore[attr-defined]
    # log(0.5) = -0.69 against the floor -10: P(yes) = 1 / (1 + e^-9.31)
    assert answer.results[0].reranker_score == pytest.approx(0.99991, abs=1e-4)  # type: ignore[attr-defined]


async def test_too_few_candidates_skips_scoring(
    start_server: StartServer, fake_llama: FakeLlamaServer
) -> None:
    server = await start_server(min_candidates=3)
    async with client_of(server) as client:
        answer = await client.rerank("q", ["x", "y"])
    assert [r.id for r in answer.results] == ["0", "1"]
    assert answer.summary.degraded_code == "too_few_candidates"
    assert fake_llama.requests == []


async def test_disabled_server_skips_scoring(
    start_server: StartServer, fake_llama: FakeLlamaServer
) -> None:
    answer = await _rerank(start_server, disabled=True)
    _assert_retrieval_order(answer, "disabled")
    assert fake_llama.requests == []


async def test_grpc_deadline_shortens_budget_and_still_answers(
    client: AsyncRerankClient, fake_llama: FakeLlamaServer
) -> None:
    """A caller deadline shorter than scoring gets a degraded answer in time, not an error."""
    fake_llama.latency_s = 2.0
    answer = await client.rerank("q", DOCS, timeout=0.5)
    assert not answer.reranked
    assert answer.summary.degraded_code == "timeout"


async def test_request_timeout_option_applies(
    client: AsyncRerankClient, fake_llama: FakeLlamaServer
) -> None:
    fake_llama.latency_s = 1.0
    answer = await client.rerank("q", DOCS, timeout_ms=150)
    assert answer.summary.degraded_code == "timeout"
    assert answer.summary.total_ms < 900


@pytest.mark.parametrize(
    ("mode", "answered"),
    [
        (llama.NOT_JSON, False),  # not an answer: the streak stands
        (llama.NO_LOGPROBS, True),  # JSON of the wrong shape: answered, if uselessly
    ],
)
async def test_an_answer_that_is_not_json_does_not_count_as_answered(
    start_server: StartServer, fake_llama: FakeLlamaServer, mode: str, answered: bool
) -> None:
    """`chat` decodes its answers itself (typed, only the fields it reads) and keeps the
    instance's health as the HTTP client's decoding kept it: bytes that are not JSON leave
    its failure streak as it was, JSON of the wrong shape clears it (`completion`: in
    test_backends_http.py)."""
    fake_llama.mode = mode
    server = await start_server()
    endpoint = server.pool.endpoints[0]
    endpoint.failures_in_row = 1
    async with client_of(server) as client:
        answer = await client.rerank("q", DOCS, blend_strategy="rerank_only")
    _assert_retrieval_order(answer, "malformed_response")
    assert endpoint.failures_in_row == (0 if answered else 1)


async def test_a_capped_and_partial_answer_says_every_reason(
    start_server: StartServer, fake_llama: FakeLlamaServer
) -> None:
    """Pairs failed among those scored and candidates past `max_candidates`: both reasons
    are said, the failure first (it is `degraded_code`)."""
    fake_llama.failing_markers = ("document b",)
    server = await start_server()
    async with client_of(server) as client:
        answer = await client.rerank("q", DOCS, blend_strategy="rerank_only", max_candidates=3)
    s = answer.summary
    assert s.degraded_code == "partial"
    assert [code for code, _ in s.degraded_reasons] == ["partial", "capped"]
    assert "1 of 3 pairs failed" in s.degraded_reasons[0][1]
    assert "2 of 5 candidates were not scored" in s.degraded_reasons[1][1]
    # The scored pairs, then the failed one, then the capped ones in retrieval order.
    assert [r.id for r in answer.results][2:] == list("bde")
