"""The `embedding` backend's wire: embeddings asked for as base64 (OpenAI's
`encoding_format`, which llama-server, vLLM and TEI speak), floats from a backend that
ignores or refuses the option, answers whose entries come out of order, and vectors that
are not numbers. The real llama-server's base64 answers are in tests/real."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import Any

import pytest
from rerank_client import AsyncRerankClient

from tests.conftest import StartServer, client_of
from tests.fakes.embeddings import FakeEmbeddings, leaning

DOCS = ["a relevant passage", "noise", "another relevant one", "more noise"]
QUERY = "what is relevant"


def expected_score(text: str) -> float:
    """The cosine the server should find between the query's embedding and `text`'s."""
    q, d = leaning(QUERY), leaning(text)
    dot = sum(x * y for x, y in zip(q, d, strict=True))
    return dot / (math.sqrt(sum(x * x for x in q)) * math.sqrt(sum(y * y for y in d)))


@pytest.fixture
async def embedding_backend(
    start_server: StartServer,
) -> AsyncIterator[Any]:
    """Start `fake`, then a rerank-server with the `embedding` backend on it; returns
    (fake, client)."""
    fakes: list[FakeEmbeddings] = []
    clients: list[AsyncRerankClient] = []

    async def start(
        fake: FakeEmbeddings,
        max_batch: int = 32,
    ) -> tuple[FakeEmbeddings, AsyncRerankClient]:
        fakes.append(fake.start())
        server = await start_server(backend="embedding", backend_url=fake.url, max_batch=max_batch)
        clients.append(client_of(server))
        return fake, clients[-1]

    yield start
    for client in clients:
        await client.close()
    for fake in fakes:
        fake.stop()


@pytest.mark.parametrize(
    ("max_batch", "inputs"),
    [
        (32, [[QUERY, *DOCS]]),  # the query with the documents: one call
        (2, [[QUERY], DOCS[:2], DOCS[2:]]),  # the query on its own, then slices of two
    ],
)
async def test_embeddings_come_as_base64_and_score_their_documents(
    embedding_backend: Any, max_batch: int, inputs: list[list[str]]
) -> None:
    fake, client = await embedding_backend(FakeEmbeddings(), max_batch=max_batch)
    answer = await client.rerank(QUERY, DOCS, blend_strategy="rerank_only")
    assert answer.reranked and answer.summary.scored == len(DOCS)
    calls = fake.posts("/v1/embeddings")
    assert sorted(c.body["input"] for c in calls) == sorted(inputs)
    assert all(c.body["encoding_format"] == "base64" for c in calls)
    for result in answer.results:  # float32 on the wire: equal to about 1e-7
        assert result.reranker_score == pytest.approx(expected_score(DOCS[result.index]), abs=1e-6)
    assert [r.index for r in answer.results][:2] == [0, 2]


async def test_a_backend_that_refuses_base64_gets_floats_from_then_on(
    embedding_backend: Any,
) -> None:
    fake, client = await embedding_backend(FakeEmbeddings(base64="refuse"))
    for i in range(2):  # two queries: the second is not answered from the score cache
        answer = await client.rerank(f"{QUERY} {i}", DOCS, blend_strategy="rerank_only")
        assert answer.reranked and answer.summary.failed == 0
    formats = [c.body.get("encoding_format") for c in fake.posts("/v1/embeddings")]
    # Refused once, then asked again for floats, and never for base64 again.
    assert formats == ["base64", None, None], formats


async def test_entries_out_of_order_score_their_own_documents(embedding_backend: Any) -> None:
    """The answer's `index` says which text an embedding belongs to, not its position."""
    _, client = await embedding_backend(FakeEmbeddings(reverse=True))
    answer = await client.rerank(QUERY, DOCS, blend_strategy="rerank_only")
    assert answer.summary.scored == len(DOCS)
    for result in answer.results:
        assert result.reranker_score == pytest.approx(expected_score(DOCS[result.index]), abs=1e-6)


async def test_an_embedding_that_is_not_a_number_fails_its_pair_only(
    embedding_backend: Any,
) -> None:
    _, client = await embedding_backend(FakeEmbeddings(nan_for="noise"))
    answer = await client.rerank(QUERY, DOCS, blend_strategy="rerank_only")
    assert answer.reranked and answer.summary.degraded_code == "partial"
    assert answer.summary.scored == 2 and answer.summary.failed == 2
    failed = {r.index for r in answer.results if r.reranker_score is None}
    assert failed == {1, 3}


@pytest.mark.parametrize("embedding", ["AAAAAAA=", "not base64!", ""])
async def test_an_embedding_that_is_not_whole_float32s_fails_the_call(
    embedding_backend: Any, embedding: str
) -> None:
    """Five bytes, characters outside base64, nothing: malformed, never a crash."""
    _, client = await embedding_backend(FakeEmbeddings(embedding=embedding))
    answer = await client.rerank(QUERY, DOCS)
    assert not answer.reranked and answer.summary.degraded_code == "malformed_response"


async def test_a_refusal_that_was_not_about_base64_keeps_base64(embedding_backend: Any) -> None:
    """A 422 for an input the backend refuses in any format (vLLM's over-long input, say)
    is tried once with floats, fails again, and base64 stays on for the next request."""

    def refuses_poison(body: Any) -> tuple[int, Any] | None:
        if any("poison" in text for text in body["input"]):
            return 422, {"object": "error", "message": "input rejected"}
        return None

    fake, client = await embedding_backend(FakeEmbeddings(instead=refuses_poison))
    failed = await client.rerank(QUERY, [*DOCS, "poison"])
    assert failed.summary.degraded_code == "backend_error"
    answer = await client.rerank(f"{QUERY} again", DOCS)
    assert answer.reranked and answer.summary.failed == 0
    formats = [c.body.get("encoding_format") for c in fake.posts("/v1/embeddings")]
    assert formats == ["base64", None, "base64"], formats


async def test_a_repeated_index_scores_no_other_document(embedding_backend: Any) -> None:
    """Two entries naming the same text: neither is taken (which is its own is unknown;
    the last used to be), the text none names fails too, and no score lands on another
    document."""

    # Entry 2 claims text 1 (DOCS[0]); none has 2.
    _, client = await embedding_backend(FakeEmbeddings(claimed_index={2: 1}))
    answer = await client.rerank(QUERY, DOCS, blend_strategy="rerank_only")
    by_index = {r.index: r.reranker_score for r in answer.results}
    assert by_index[1] is None  # DOCS[1]'s text was never embedded
    assert by_index[0] is None  # named twice: it used to get DOCS[1]'s vector
    for i in (2, 3):
        assert by_index[i] == pytest.approx(expected_score(DOCS[i]), abs=1e-6)


async def test_an_input_too_large_to_process_fails_its_request_not_the_instance(
    embedding_backend: Any,
) -> None:
    """llama-server refuses an embedding input longer than its physical batch with a
    500: that is the input's fault. It was retried as a server error and counted against
    the instance, which three such requests ejected, for everyone."""
    fake, client = await embedding_backend(FakeEmbeddings(physical_batch=256, names_batch=False))
    for _ in range(4):
        refused = await client.rerank(QUERY, ["LONG " * 80, *DOCS])
        assert not refused.reranked
    assert len(fake.posts("/v1/embeddings")) == 4  # each tried once, not again elsewhere
    answer = await client.rerank(QUERY, DOCS, blend_strategy="rerank_only")
    assert answer.reranked and answer.summary.scored == len(DOCS)


async def test_an_input_over_the_physical_batch_it_names_is_cut_to_it(
    embedding_backend: Any,
) -> None:
    """The refusal names llama-server's physical batch (`-ub`, which `/props` does not
    report): the texts are cut to it and sent again, and later requests are cut before
    they are sent. Every request with a long text used to fail all of its pairs."""
    fake, client = await embedding_backend(FakeEmbeddings(physical_batch=256))
    for n in range(3):  # a query each: no score comes from the cache
        answer = await client.rerank(f"{QUERY} {n}", ["LONG " * 80, *DOCS])
        assert answer.reranked and answer.summary.failed == 0, n
    sent = [c.body["input"] for c in fake.posts("/v1/embeddings")]
    assert len(sent) == 4  # refused once, then every call passes
    assert all(len(text.encode()) <= 256 for call in sent[1:] for text in call)
