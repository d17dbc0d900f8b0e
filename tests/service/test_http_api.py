"""The JSON rerank API over real HTTP on loopback: the official Cohere SDK (v1 and v2
clients, unmodified), TEI's shape, tokens, errors, health, models, OpenAPI."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import cohere
import httpx
import pytest
from cohere.core.api_error import ApiError

from rerank_server.http_api import server as http_server_module
from rerank_server.managed.child_process import free_port
from rerank_server.security import timeouts
from rerank_server.server import RunningServer
from tests.conftest import StartServer
from tests.fakes.llama import FakeLlamaServer
from tests.waiting import eventually

TOKEN = "test-token-0123456789abcdef"
DOCS = [
    "Cats are obligate carnivores that eat meat.",
    "The stock market fell.",
    "Kittens need milk.",
    "Dogs eat almost anything.",
]


@pytest.fixture
async def http_server(
    start_server: StartServer,
    fake_llama: FakeLlamaServer,
) -> RunningServer:
    fake_llama.scores = {"Cats": 0.95, "Kittens": 0.9, "stock": 0.01, "Dogs": 0.3}
    return await start_server(
        http_port=free_port(), auth_tokens=TOKEN, blend_strategy="rerank_only"
    )


def base_url(server: RunningServer) -> str:
    return f"http://127.0.0.1:{server.http_port}"


@contextlib.contextmanager
def sdk(kind: type[Any], server: RunningServer, token: str | None) -> Iterator[Any]:
    """An official Cohere client pointed at the server, its connections closed after."""
    with httpx.Client() as transport:
        yield kind(api_key=token or "", base_url=base_url(server), httpx_client=transport)


async def test_cohere_v1_client_reranks_unmodified(http_server: RunningServer) -> None:
    with sdk(cohere.Client, http_server, TOKEN) as co:
        answer = await asyncio.to_thread(
            co.rerank,
            model="rerank-english-v3.0",
            query="what do cats eat?",
            documents=DOCS,
            top_n=3,
            return_documents=True,
        )
    assert [r.index for r in answer.results] == [0, 2, 3]
    scores = [r.relevance_score for r in answer.results]
    assert scores == sorted(scores, reverse=True)
    assert answer.results[0].document is not None
    assert answer.results[0].document.text == DOCS[0]
    assert answer.meta is not None and answer.meta.api_version is not None
    assert answer.meta.api_version.version == "1"


async def test_cohere_v2_client_reranks_unmodified(http_server: RunningServer) -> None:
    with sdk(cohere.ClientV2, http_server, TOKEN) as co:
        answer = await asyncio.to_thread(
            co.rerank, model="rerank-v3.5", query="what do cats eat?", documents=DOCS
        )
    assert [r.index for r in answer.results] == [0, 2, 3, 1]
    extra: Any = answer.meta
    assert extra.reranked is True and extra.backend == "chat"


async def test_a_client_without_a_valid_token_is_refused(
    http_server: RunningServer, fake_llama: FakeLlamaServer
) -> None:
    with (
        sdk(cohere.ClientV2, http_server, "wrong-token-0123456789abc") as co,
        pytest.raises(ApiError) as info,
    ):
        await asyncio.to_thread(co.rerank, model="m", query="q", documents=DOCS)
    assert info.value.status_code == 401
    # No token at all (the Cohere SDK sends `Bearer ` for an empty key, which httpx
    # itself refuses to send): plain HTTP.
    async with httpx.AsyncClient(base_url=base_url(http_server)) as http:
        bare = await http.post("/v2/rerank", json={"query": "q", "documents": DOCS})
    assert bare.status_code == 401 and bare.headers["www-authenticate"] == "Bearer"
    assert fake_llama.requests == []


async def test_tei_shape_and_our_extras(http_server: RunningServer) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(base_url=base_url(http_server), headers=headers) as http:
        tei = (
            await http.post("/rerank", json={"query": "cats", "texts": DOCS, "return_text": True})
        ).json()
        extras = (
            await http.post(
                "/v1/rerank",
                json={
                    "query": "cats",
                    "blend_strategy": "position_aware",
                    "request_id": "r-1",
                    "documents": [
                        {"text": d, "id": f"doc-{i}", "retrieval_rank": 4 - i}
                        for i, d in enumerate(DOCS)
                    ],
                },
            )
        ).json()
    assert [r["index"] for r in tei] == [0, 2, 3, 1]
    assert tei[0]["text"] == DOCS[0] and tei[0]["score"] >= tei[1]["score"]
    assert extras["id"] == "r-1" and extras["meta"]["blend_strategy"] == "position_aware"
    assert extras["results"][0]["id"].startswith("doc-")
    assert all(r["reranker_score"] is not None for r in extras["results"])


async def test_return_documents_gives_each_document_back_as_sent(
    http_server: RunningServer,
) -> None:
    """Object documents come back whole (every field, ours and the caller's, those sent
    as null too), not as the `rank_fields` text the model read; ids given for some
    documents only are kept, the others default to their index."""
    documents: list[Any] = [
        {
            "id": "cats-doc",
            "title": "Cats",
            "body": DOCS[0],
            "tags": "pets",
            "year": 2024,
            "url": None,
            "text": None,
        },  # nulls too: the document as sent
        DOCS[1],
        {"title": "Kittens", "body": DOCS[2]},
    ]
    async with httpx.AsyncClient(base_url=base_url(http_server)) as http:
        reply = await http.post(
            "/v1/rerank",
            headers={"Authorization": f"Bearer {TOKEN}"},
            json={
                "query": "cats",
                "documents": documents,
                "rank_fields": ["title", "body"],
                "return_documents": True,
            },
        )
    results = {r["index"]: r for r in reply.json()["results"]}
    assert reply.status_code == 200, reply.json()
    assert results[0]["document"] == documents[0] and results[0]["id"] == "cats-doc"
    assert results[1]["document"] == {"text": DOCS[1]} and results[1]["id"] == "1"
    assert results[2]["document"] == documents[2] and results[2]["id"] == "2"
    # A field the model does not read, echoed whole, must encode too: refused, named,
    # rather than a 500 when the answer is written.
    async with httpx.AsyncClient(base_url=base_url(http_server)) as http:
        lone = await http.post(
            "/v1/rerank",
            headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
            content='{"query": "q", "return_documents": true, "documents": '
            '[{"text": "a", "url": "\\ud800"}, "b"]}',
        )
    assert lone.status_code == 422
    assert lone.json()["message"] == "documents[0].url: is not valid Unicode (a lone surrogate)"


async def test_a_rerank_body_is_parsed_once(
    http_server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gate's decode (msgspec) is the body's only parse: FastAPI validates what it
    decoded instead of reading the bytes again. A body with a lone surrogate escape,
    which msgspec cannot hold, is read by the standard library once, after its shape."""
    bodies = {
        "/v1/rerank": json.dumps({"query": "cats", "documents": DOCS, "top_n": 2}),
        "/v2/rerank": json.dumps({"query": "cats", "documents": DOCS}),
        "/rerank": json.dumps({"query": "cats", "texts": DOCS}),
    }
    lone = '{"query": "q", "documents": [{"text": "a", "url": "\\ud800"}, "b"]}'
    parsed: list[str] = []
    loads = json.loads

    def counting(text: str | bytes, *args: Any, **kwargs: Any) -> Any:
        as_text = text.decode() if isinstance(text, bytes) else text
        if as_text in (*bodies.values(), lone):
            parsed.append(as_text)
        return loads(text, *args, **kwargs)

    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    async with httpx.AsyncClient(base_url=base_url(http_server), headers=headers) as http:
        monkeypatch.setattr(json, "loads", counting)
        answers = [await http.post(path, content=body) for path, body in bodies.items()]
        surrogate = await http.post("/v1/rerank", content=lone)
        monkeypatch.undo()
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert answers[0].json()["results"][0]["index"] == 0
    assert len(answers[2].json()) == len(DOCS)
    assert surrogate.status_code == 200, surrogate.json()
    assert parsed == [lone]


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"query": "", "documents": ["a"]}, 422, "query: must not be empty"),
        (
            {"query": "q", "documents": [{"id": "x", "text": "a"}, {"id": "x", "text": "b"}]},
            422,
            "documents[1].id: duplicate of documents[0].id",
        ),
        # An id given for one document that is another's default (its index): named as such.
        (
            {"query": "q", "documents": [{"id": "1", "text": "a"}, "b"]},
            422,
            "documents[1].id: not given, so its index '1', which documents[0] gives as its id",
        ),
        ({"query": "q", "documents": [1]}, 422, "documents[0]"),
        ({"query": "q"}, 422, "documents: Field required"),
        ({"query": "q", "documents": ["a"], "blend_strategy": "magic"}, 422, "blend_strategy"),
        # JSON's own types, not what a string or a float might be read as.
        (
            {"query": "q", "documents": ["a"], "top_n": "2"},
            422,
            "top_n: Input should be a valid integer",
        ),
        (
            {"query": "q", "documents": ["a"], "return_documents": "yes"},
            422,
            "return_documents: Input should be a valid boolean",
        ),
        (
            {"query": "q", "documents": [{"text": "a", "retrieval_rank": 1.5}]},
            422,
            "documents[0].retrieval_rank: Input should be a valid integer",
        ),
        # An object with nothing to read was scored as an empty text.
        (
            {"query": "q", "documents": ["a", {"title": "t"}]},
            422,
            "documents[1].text: missing: a document given as an object needs its text",
        ),
        (
            {"query": "q", "documents": [{"title": "t"}], "rank_fields": ["body"]},
            422,
            "documents[0]: has none of the rank_fields ('body')",
        ),
        # Field names are quoted back (and logged): each is capped, and quoted cut to 64
        # characters (64 names of 200,000 characters made a 14 MB answer and log line).
        (
            {"query": "q", "documents": ["a"], "rank_fields": ["f" * 257]},
            422,
            "rank_fields[0]: String should have at most 256 characters",
        ),
        (
            {"query": "q", "documents": [{"title": "t"}], "rank_fields": ["b" * 256]},
            422,
            f"documents[0]: has none of the rank_fields ('{'b' * 64}')",
        ),
        # The shape check's words, not msgspec's union (which seemed to allow numbers).
        (
            {"query": "q", "documents": ["a", ["x"]]},
            422,
            "documents[1]: expected a string, or an object with text, got `array`",
        ),
    ],
)
async def test_errors_are_json_and_name_the_field(
    http_server: RunningServer, body: dict[str, Any], status: int, message: str
) -> None:
    async with httpx.AsyncClient(base_url=base_url(http_server)) as http:
        reply = await http.post(
            "/v1/rerank", json=body, headers={"Authorization": f"Bearer {TOKEN}"}
        )
    assert reply.status_code == status
    assert reply.json()["message"].startswith(message), reply.json()


async def test_a_whole_number_written_as_a_float_is_accepted(http_server: RunningServer) -> None:
    """Python's `json.dumps` writes `1.5 * 1000` as `1500.0`: strict types, but not that
    strict."""
    async with httpx.AsyncClient(base_url=base_url(http_server)) as http:
        reply = await http.post(
            "/v1/rerank",
            headers={"Authorization": f"Bearer {TOKEN}"},
            json={"query": "cats", "documents": DOCS, "top_n": 2.0, "timeout_ms": 1500.0},
        )
    assert reply.status_code == 200, reply.json()
    assert len(reply.json()["results"]) == 2


async def test_health_is_open_models_need_a_token_openapi_lists_the_routes(
    http_server: RunningServer,
) -> None:
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
    assert {"/v1/rerank", "/v2/rerank", "/rerank", "/health", "/v1/models"} <= set(spec["paths"])


async def test_a_body_that_is_not_json_by_its_type_gets_415_naming_the_type(
    http_server: RunningServer,
) -> None:
    """curl's `-d` sends application/x-www-form-urlencoded: FastAPI read such a body as
    a form and answered 422 "Input should be a valid dictionary"."""
    body = json.dumps({"query": "cats", "documents": DOCS}).encode()
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(base_url=base_url(http_server)) as http:
        form = await http.post(
            "/v1/rerank",
            content=body,
            headers={**auth, "Content-Type": "application/x-www-form-urlencoded"},
        )
        untyped = await http.post("/rerank", content=body, headers=auth)
        charset = await http.post(
            "/v1/rerank",
            content=body,
            headers={**auth, "Content-Type": "application/json; charset=utf-8"},
        )
    assert form.status_code == 415 and untyped.status_code == 415
    assert form.json()["message"] == "Content-Type must be application/json"
    assert charset.status_code == 200


async def test_health_answers_head_and_keeps_the_model_for_token_holders(
    start_server: StartServer, http_server: RunningServer
) -> None:
    """Some load balancers probe with HEAD. `/health` is open, so with tokens on the
    model's name is left to `/v1/models`, which needs one (docs/security.md)."""
    open_server = await start_server(http_port=free_port())
    async with httpx.AsyncClient() as http:
        assert await eventually(lambda: _up(http, base_url(http_server)), 10)
        assert await eventually(lambda: _up(http, base_url(open_server)), 10)
        head = await http.head(base_url(http_server) + "/health")
        guarded = await http.get(base_url(http_server) + "/health")
        unguarded = await http.get(base_url(open_server) + "/health")
    assert head.status_code == 200 and head.content == b""
    assert guarded.json()["model"] == ""
    assert unguarded.json()["model"] == "fake-reranker.gguf"


async def _up(http: httpx.AsyncClient, url: str) -> bool:
    return (await http.get(url + "/health")).status_code == 200


async def test_health_says_503_while_the_backend_is_down(
    start_server: StartServer, fake_llama: FakeLlamaServer
) -> None:
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
    start_server: StartServer,
) -> None:
    server = await start_server(
        http_port=free_port(), auth_tokens=TOKEN, max_message_bytes=64 * 1024
    )
    big = b'{"query": "q", "documents": ["' + b"x" * 200_000 + b'"]}'
    async with httpx.AsyncClient(base_url=base_url(server)) as http:
        anonymous = await http.post(
            "/v1/rerank", content=big, headers={"Content-Type": "application/json"}
        )
        small_anonymous = await http.post("/v1/rerank", json={"query": "q", "documents": DOCS})
        too_big = await http.post(
            "/v1/rerank",
            content=big,
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"},
        )
    assert anonymous.status_code in (401, 413)  # either way, refused from the headers
    assert small_anonymous.status_code == 401
    assert too_big.status_code == 413 and too_big.headers["connection"] == "close"
    assert too_big.json()["message"] == (
        f"body of {len(big)} bytes exceeds the limit of {64 * 1024} (max_message_bytes)"
    )


async def test_bodies_refused_as_they_arrive_give_their_bytes_back(
    start_server: StartServer,
) -> None:
    """Chunked bodies over --max-message-bytes are refused as they arrive (413, JSON, and
    the server hangs up), and what they had counted against --max-inflight-bytes is given
    back: three of them would otherwise leave the budget full for good, for gRPC too."""
    server = await start_server(
        http_port=free_port(),
        auth_tokens=TOKEN,
        max_message_bytes=64 * 1024,
        max_inflight_bytes=128 * 1024,
    )

    async def over_the_limit() -> bytes:
        # Stops sending at the chunk that passes the limit: everything sent is read, so
        # the hang-up is a clean close and the answer can be read (a client still
        # sending may see the connection reset instead).
        reader, writer = await asyncio.open_connection("127.0.0.1", server.http_port)
        writer.write(
            b"POST /v1/rerank HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
            b"Content-Type: application/json\r\nAuthorization: Bearer "
            + TOKEN.encode()
            + b"\r\n\r\n"
            + b"3e8\r\n"
            + b"x" * 1000
            + b"\r\n"
        )
        for _ in range(65):  # 66 chunks in all: the last one passes 64 KiB
            writer.write(b"3e8\r\n" + b"x" * 1000 + b"\r\n")
            await writer.drain()
            await asyncio.sleep(0)
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        return answer

    refused = [await over_the_limit() for _ in range(3)]
    async with httpx.AsyncClient(base_url=base_url(server)) as http:
        after = await http.post(
            "/v1/rerank",
            headers={"Authorization": f"Bearer {TOKEN}"},
            json={"query": "q", "documents": ["x" * 10_000] * 3},
        )
    for answer in refused:
        assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
        assert b"connection: close" in answer.lower()
        assert b'{"message":"body exceeds the limit of 65536 bytes' in answer
    assert after.status_code == 200, after.json()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            '{"query": "q", "documents": ["a", "b"], "max_candidates": 500}',
            "max_candidates: must be between 1 and 100",
        ),
        (
            '{"query": "q", "documents": ["ok", "bad \\ud800 text"]}',  # valid JSON, not UTF-8
            "documents[1].text: is not valid Unicode",
        ),
    ],
)
async def test_http_errors_name_the_field_as_the_client_wrote_it(
    http_server: RunningServer, body: str, message: str
) -> None:
    async with httpx.AsyncClient(base_url=base_url(http_server)) as http:
        reply = await http.post(
            "/v1/rerank",
            content=body,
            headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        )
    assert reply.status_code == 422
    assert reply.json()["message"].startswith(message), reply.json()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        # Echoed as the answer's `id`: a lone surrogate there made the answer fail (a 500).
        (
            '{"query": "q", "request_id": "\\ud800", "documents": ["a", "b", "c"]}',
            "request_id: is not valid Unicode",
        ),
        # Refused by count before any candidate is built.
        (
            '{"query": "q", "documents": [' + ", ".join(['""'] * 5000) + "]}",
            "documents: 5000 candidates exceeds the limit of 100",
        ),
        (
            '{"query": "q", "documents": [{"text": "a"}], "rank_fields": ['
            + ", ".join(['"f"'] * 65)
            + "]}",
            "rank_fields: List should have at most 64 items",
        ),
        # An object document's own problem, not "should be a string".
        (
            '{"query": "q", "documents": [{"text": 5}]}',
            "documents[0].text: Input should be a valid string",
        ),
        (
            '{"query": "q", "documents": [{"text": "a", "retrieval_rank": 0}]}',
            "documents[0].retrieval_rank: Input should be greater than or equal to 1",
        ),
        ('{"query": "q", "documents": [', "body: not valid JSON (Input data was truncated)"),
        # Nested past msgspec's depth under a field nobody reads: a 422, not a 500.
        (
            '{"query": "q", "documents": ["a"], "x": ' + "[" * 1000 + "]" * 1000 + "}",
            "body: nested too deeply",
        ),
        # A document object of many fields, refused before the standard library and pydantic
        # build it twice more (1.3 million fields: 333 MiB and 3 s of blocked loop).
        (
            '{"query": "q", "documents": [{"text": "a", '
            + ", ".join(f'"k{i}": 0' for i in range(300))
            + "}]}",
            "documents[0]: expected `object` of length <= 256",
        ),
        # Integers past 64 bits overflowed float arithmetic: a 500, one after scoring.
        (
            '{"query": "q", "documents": ["a"], "timeout_ms": 1' + "0" * 400 + "}",
            "timeout_ms: Value error, must be at most 9223372036854775807",
        ),
        (
            '{"query": "q", "documents": [{"text": "a", "retrieval_rank": 1' + "0" * 400 + "}]}",
            "documents[0].retrieval_rank: Value error, must be at most",
        ),
    ],
)
async def test_bad_bodies_get_a_422_that_says_what_is_wrong(
    http_server: RunningServer, body: str, message: str
) -> None:
    async with httpx.AsyncClient(base_url=base_url(http_server)) as http:
        reply = await http.post(
            "/v1/rerank",
            content=body,
            headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        )
        texts = await http.post(
            "/rerank",
            content='{"query": "q", "texts": [' + ", ".join(['"t"'] * 101) + "]}",
            headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        )
    assert reply.status_code == 422
    assert reply.json()["message"].startswith(message), reply.json()
    assert texts.status_code == 422
    assert texts.json()["message"] == "texts: 101 candidates exceeds the limit of 100"


async def test_tei_errors_name_texts_as_plain_strings(http_server: RunningServer) -> None:
    async with httpx.AsyncClient(base_url=base_url(http_server)) as http:
        reply = await http.post(
            "/rerank",
            content='{"query": "q", "texts": ["a", "b \\ud800"]}',
            headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        )
    assert reply.status_code == 422
    assert reply.json()["message"] == "texts[1]: is not valid Unicode (a lone surrogate)"


async def test_framework_errors_have_the_same_json_shape(http_server: RunningServer) -> None:
    async with httpx.AsyncClient(base_url=base_url(http_server)) as http:
        missing = await http.get("/nowhere", headers={"Authorization": f"Bearer {TOKEN}"})
        wrong_method = await http.get("/v1/rerank", headers={"Authorization": f"Bearer {TOKEN}"})
    assert missing.status_code == 404 and missing.json() == {"message": "Not Found"}
    assert wrong_method.status_code == 405
    assert wrong_method.json() == {"message": "Method Not Allowed"}


async def _stalled(port: int, sent: int, length: int) -> asyncio.StreamWriter:
    """A client that sends the head of a rerank request and `sent` of its `length` body
    bytes, then nothing: the connection stays open."""
    _reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/rerank HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + TOKEN.encode() + b"\r\n"
        b"Content-Length: %d\r\n\r\n" % length + b"x" * sent
    )
    await writer.drain()
    return writer


async def test_clients_that_stop_sending_hold_no_place(start_server: StartServer) -> None:
    """A place among --max-concurrent-rpcs is taken once the body is in: two clients that
    never finish theirs do not make the server busy for everyone else."""
    server = await start_server(http_port=free_port(), auth_tokens=TOKEN, max_concurrent_rpcs=2)
    stalled = [await _stalled(server.http_port, 10, 1000) for _ in range(3)]
    await asyncio.sleep(0.2)  # their heads are read, their bodies wait
    async with httpx.AsyncClient(base_url=base_url(server)) as http:
        reply = await http.post(
            "/v1/rerank",
            json={"query": "q", "documents": DOCS},
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
    for writer in stalled:
        writer.close()
    assert reply.status_code == 200, reply.json()


async def test_body_bytes_count_against_the_budget_as_they_arrive(
    start_server: StartServer,
) -> None:
    """Bytes of a body still arriving are in --max-inflight-bytes, so clients cannot hold
    memory outside it by sending slowly."""
    server = await start_server(
        http_port=free_port(), auth_tokens=TOKEN, max_inflight_bytes=64 * 1024
    )
    stalled = await _stalled(server.http_port, 60 * 1024, 100 * 1024)
    await asyncio.sleep(0.2)
    async with httpx.AsyncClient(base_url=base_url(server)) as http:
        refused = await http.post(
            "/v1/rerank",
            headers={"Authorization": f"Bearer {TOKEN}"},
            json={"query": "q", "documents": ["x" * 5000] * 3},
        )
        stalled.close()
        await asyncio.sleep(0.2)  # its bytes are given back when it goes
        taken = await http.post(
            "/v1/rerank",
            headers={"Authorization": f"Bearer {TOKEN}"},
            json={"query": "q", "documents": ["x" * 5000] * 3},
        )
    assert refused.status_code == 429 and "max_inflight_bytes" in refused.json()["message"]
    assert taken.status_code == 200


async def test_a_body_that_never_arrives_is_refused_in_time(
    start_server: StartServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(timeouts, "BODY_TIMEOUT_S", 0.5)
    server = await start_server(http_port=free_port(), auth_tokens=TOKEN)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.http_port)
    writer.write(
        b"POST /v1/rerank HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
        b"Content-Type: application/json\r\n"
        b"Authorization: Bearer " + TOKEN.encode() + b"\r\n\r\n{"
    )
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 10)  # to the end: the server hangs up
    writer.close()
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert b'"message":"the body did not arrive within' in answer


async def _hung_up(reader: asyncio.StreamReader, within_s: float) -> bytes:
    """What the server sent before it closed the connection (raises if it did not)."""
    return await asyncio.wait_for(reader.read(), within_s)


@pytest.mark.parametrize(
    "sent", [b"", b"POST /v1/rerank HTTP/1.1\r\nHost: x\r\n"], ids=["nothing", "half a head"]
)
async def test_a_head_that_never_arrives_closes_the_connection(
    start_server: StartServer, monkeypatch: pytest.MonkeyPatch, sent: bytes
) -> None:
    """Slow-loris: such connections used to stay open for ever, each holding a file
    descriptor, after a first request on the connection as well as before one."""
    monkeypatch.setattr(http_server_module, "HEAD_TIMEOUT_S", 0.5)
    server = await start_server(http_port=free_port())
    fresh_reader, fresh = await asyncio.open_connection("127.0.0.1", server.http_port)
    fresh.write(sent)
    used_reader, used = await asyncio.open_connection("127.0.0.1", server.http_port)
    used.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" + sent)
    assert await _hung_up(fresh_reader, 5) == b""
    assert (await _hung_up(used_reader, 5)).startswith(b"HTTP/1.1 ")  # the health answer
    fresh.close()
    used.close()
    # A client that takes its time between requests but sends whole heads is served.
    async with httpx.AsyncClient(base_url=base_url(server)) as http:
        first = await http.get("/health")
        await asyncio.sleep(0.8)
        second = await http.get("/health")
    assert first.status_code == second.status_code


async def test_connections_past_the_cap_are_answered_503(start_server: StartServer) -> None:
    server = await start_server(http_port=free_port(), max_connections=3)
    held = [await asyncio.open_connection("127.0.0.1", server.http_port) for _ in range(3)]
    reader, writer = await asyncio.open_connection("127.0.0.1", server.http_port)
    refused = await _hung_up(reader, 5)
    writer.close()
    for _, w in held[1:]:
        w.close()
    await asyncio.sleep(0.2)
    async with httpx.AsyncClient(base_url=base_url(server)) as http:
        served = await http.get("/health")
    held[0][1].close()
    assert refused.startswith(b"HTTP/1.1 503 ") and b"too many connections" in refused
    assert served.status_code in (200, 503) and "backend" in served.json()


async def test_a_refused_connection_takes_no_place(
    start_server: StartServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refused connection lingers (reading what it sends) uncounted: once a connection
    under the cap closes, the next client is served though the refused one is still
    open, as it would not be if refusals kept counting."""
    monkeypatch.setattr(http_server_module, "REFUSED_LINGER_S", 30.0)
    server = await start_server(http_port=free_port(), max_connections=2)
    held = [await asyncio.open_connection("127.0.0.1", server.http_port) for _ in range(2)]
    refused_reader, refused = await asyncio.open_connection("127.0.0.1", server.http_port)
    assert (await _hung_up(refused_reader, 5)).startswith(b"HTTP/1.1 503 ")
    held[0][1].close()
    await asyncio.sleep(0.2)
    try:
        async with httpx.AsyncClient(base_url=base_url(server)) as http:
            served = await http.get("/health")
        assert served.status_code in (200, 503) and "backend" in served.json()
    finally:
        refused.close()
        held[1][1].close()


async def test_a_request_past_the_cap_gets_its_503_not_a_reset(start_server: StartServer) -> None:
    """The refused connection's request is read and dropped before it is closed: closed
    with a request of 100 KB unread, every such client saw a reset (httpx: ReadError)
    instead of the 503 it was sent, and could not tell it should retry."""
    server = await start_server(http_port=free_port(), max_connections=2)
    held = [await asyncio.open_connection("127.0.0.1", server.http_port) for _ in range(2)]
    body = {"query": "q", "documents": ["river " * 20_000]}
    try:
        async with httpx.AsyncClient(base_url=base_url(server)) as http:
            for _ in range(5):
                answer = await http.post("/v1/rerank", json=body)
                assert answer.status_code == 503
                assert answer.headers["retry-after"] == "1"
    finally:
        for _, writer in held:
            writer.close()


@pytest.mark.parametrize("where", ["documents", "junk"])
async def test_a_body_of_nested_arrays_is_refused_before_it_is_built(
    start_server: StartServer, where: str
) -> None:
    """16 MiB of `[[[[[[[[[[1]]]]]]]]]]`, as the documents or under a field the API
    ignores: the standard library's parser built 711 MB of lists from it in 14.6 s of
    blocked event loop before anything could refuse it. Now the shape check stops at the
    first array where none belongs, and health is answered meanwhile."""
    server = await start_server(http_port=free_port(), max_message_bytes=17 << 20)
    bomb = ",".join(["[[[[[[[[[[1]]]]]]]]]]"] * ((16 << 20) // 22))
    body = (
        '{"query": "q", "documents": '
        + ("[" + bomb + "]" if where == "documents" else '["a", "b"], "junk": [' + bomb + "]")
        + "}"
    ).encode()
    async with httpx.AsyncClient(base_url=base_url(server), timeout=60) as http:
        reply = asyncio.ensure_future(
            http.post("/v1/rerank", content=body, headers={"Content-Type": "application/json"})
        )
        waits = []
        while not reply.done():
            sent = time.monotonic()
            await http.get("/health")
            waits.append(time.monotonic() - sent)
            await asyncio.sleep(0.02)
        answer = await reply
    if where == "documents":
        assert answer.status_code == 422
        assert answer.json()["message"].startswith("documents[0]: expected ")
    else:  # what the API ignores is skipped unread, and the rest is answered
        assert answer.status_code == 200 and len(answer.json()["results"]) == 2
    assert max(waits) < 1.0, f"health waited {max(waits):.2f} s"


@pytest.mark.parametrize("first", ["{}", '{"text": "\\ud800"}'])
async def test_a_body_of_many_document_objects_is_refused_before_they_are_built(
    start_server: StartServer, first: str
) -> None:
    """Half a million `{}` documents (1.5 MB): strings were counted before they were
    built, objects only after pydantic had built every one (5.6 million took 34 s of
    blocked event loop). Now the shape check counts them, also on the way a lone
    surrogate takes (that body goes on to the standard library's parser)."""
    server = await start_server(http_port=free_port())
    n = 500_000
    body = ('{"query": "q", "documents": [' + first + ", {}" * (n - 1) + "]}").encode()
    async with httpx.AsyncClient(base_url=base_url(server), timeout=60) as http:
        reply = asyncio.ensure_future(
            http.post("/v1/rerank", content=body, headers={"Content-Type": "application/json"})
        )
        # The server runs on this event loop: a health call's own time would miss a
        # block that fell while none was out, the time between two would not.
        waits, last = [], time.monotonic()
        while not reply.done():
            await http.get("/health")
            await asyncio.sleep(0.02)
            waits.append(time.monotonic() - last - 0.02)
            last = time.monotonic()
        answer = await reply
    assert answer.status_code == 422
    assert answer.json()["message"] == f"documents: {n} candidates exceeds the limit of 100"
    assert max(waits) < 1.0, f"health waited {max(waits):.2f} s"


async def test_an_answer_its_client_never_reads_is_not_kept_for_ever(
    start_server: StartServer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A client that asks for a large answer and reads none of it (its receive buffer
    small, as a slow or hostile one's is): what the kernel would not take stayed in the
    server's memory for as long as the client kept the connection, 13 MB a connection
    here. Now the connection goes once nothing was taken for SEND_STALL_S."""
    monkeypatch.setattr(timeouts, "SEND_STALL_S", 1.0)
    server = await start_server(
        http_port=free_port(), max_candidates=100, max_message_bytes=16 << 20
    )
    docs = [f"{i} " + "x" * 130_000 for i in range(100)]  # 13 MB back
    body = json.dumps({"query": "q", "documents": docs, "return_documents": True}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    sock.connect(("127.0.0.1", server.http_port))
    reader, writer = await asyncio.open_connection(sock=sock)
    writer.write(
        b"POST /v1/rerank HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    await writer.drain()  # and read nothing
    out = ""

    def stalled() -> bool:
        nonlocal out
        out += capsys.readouterr().out
        return '"event":"http_send_stalled"' in out

    assert await eventually(stalled, 20, poll_s=0.1)
    received = 0
    with contextlib.suppress(ConnectionError):
        while chunk := await asyncio.wait_for(reader.read(1 << 20), 10):
            received += len(chunk)
    writer.close()
    assert received < len(body)  # cut off: the rest was dropped with the connection


async def test_a_body_dribbled_after_its_answer_does_not_hold_the_connection(
    start_server: StartServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Answered before its body was read (a health check, a 401, a 429), a request whose
    body then comes a byte at a time: no timer ran any more, so the connection was held
    for ever (and 1,024 of them shut every new client out). Now the next head is awaited
    from the answer on."""
    monkeypatch.setattr(http_server_module, "HEAD_TIMEOUT_S", 0.5)
    server = await start_server(http_port=free_port())
    reader, writer = await asyncio.open_connection("127.0.0.1", server.http_port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\n")
    await writer.drain()
    answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    closed = False
    try:
        for _ in range(40):  # a byte every 0.1 s, for up to 4 s
            writer.write(b"x")
            await writer.drain()
            with contextlib.suppress(TimeoutError):
                if not await asyncio.wait_for(reader.read(65536), 0.1):
                    closed = True
                    break
    except ConnectionError:
        closed = True
    writer.close()
    assert answer.startswith(b"HTTP/1.1 ")
    assert closed


async def test_a_request_id_over_its_limit_is_not_logged(
    http_server: RunningServer, capsys: pytest.CaptureFixture[str]
) -> None:
    async with httpx.AsyncClient(base_url=base_url(http_server)) as http:
        reply = await http.post(
            "/v1/rerank",
            headers={"Authorization": f"Bearer {TOKEN}"},
            json={"query": "q", "documents": ["a", "b"], "request_id": "R" * 100_000},
        )
    out = capsys.readouterr().out
    assert reply.status_code == 422 and reply.json()["message"].startswith("request_id: ")
    assert "R" * 600 not in out and '"request_id":""' in out


async def test_every_refusal_of_a_rerank_request_has_its_log_line(
    http_server: RunningServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refusals by pydantic's validation (a wrong type, an unknown blend) had no `rpc`
    line, where the shape check's and the rules' had (docs/http.md)."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    capsys.readouterr()
    async with httpx.AsyncClient(base_url=base_url(http_server)) as http:
        for body in (
            {"query": "q", "documents": ["a"], "top_n": "x"},
            {"query": "q", "documents": ["a"], "blend_strategy": "magic"},
        ):
            assert (await http.post("/v1/rerank", json=body, headers=auth)).status_code == 422
        tei = await http.post("/rerank", json={"query": "q", "texts": ["a", 5]}, headers=auth)
    assert tei.status_code == 422
    lines = [
        json.loads(line)
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("{") and '"event":"rpc"' in line
    ]
    assert [(e["rpc"], e["status"], e["error"].split(":")[0]) for e in lines] == [
        ("POST /v1/rerank", "422", "top_n"),
        ("POST /v1/rerank", "422", "blend_strategy"),
        ("POST /rerank", "422", "texts[1]"),
    ]


async def test_a_grace_period_of_part_seconds_is_kept_whole(
    start_server: StartServer, fake_llama: FakeLlamaServer
) -> None:
    """uvicorn was given the grace period cut to whole seconds: 1.9 s became 1 s, and a
    request due 1.2 s after the stop was cancelled into a plain-text 500. (Scoring may
    go on until 1.425 s: the grace less a quarter of it.)"""
    fake_llama.latency_s = 1.2
    server = await start_server(http_port=free_port(), grace_period_s=1.9)
    async with httpx.AsyncClient(base_url=base_url(server), timeout=10) as http:
        call = asyncio.create_task(
            http.post("/v1/rerank", json={"query": "cats", "documents": DOCS, "timeout_ms": 5000})
        )
        # The call is now waiting on the backend.
        assert await asyncio.to_thread(fake_llama.received.wait, 10)
        await server.stop(grace=1.9)
        reply = await call
    assert reply.status_code == 200, reply.text
    assert reply.json()["meta"]["reranked"] is True


async def test_bad_utf8_is_placed_by_its_byte_in_the_body(http_server: RunningServer) -> None:
    """The offset was counted from the start of the string holding it ("at byte 1")."""
    async with httpx.AsyncClient(base_url=base_url(http_server)) as http:
        reply = await http.post(
            "/v1/rerank",
            content=b'{"query":"q","documents":["a\xff"]}',
            headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        )
    assert reply.status_code == 422
    assert reply.json()["message"] == "body: not valid UTF-8 at byte 28"


async def test_a_refusal_after_a_slow_body_counts_the_time_it_took(
    http_server: RunningServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """The gate's refusals logged `total_ms` from the moment they were sent (about 0),
    not from the request's arrival: a body that took 0.3 s to come, then refused, read
    as instant."""

    async def slowly() -> AsyncIterator[bytes]:
        yield b'{"query":"q","documents":["a'
        await asyncio.sleep(0.3)
        yield b'\xff"]}'

    capsys.readouterr()
    async with httpx.AsyncClient(base_url=base_url(http_server)) as http:
        reply = await http.post(
            "/v1/rerank",
            content=slowly(),
            headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        )
    assert reply.status_code == 422 and "UTF-8" in reply.json()["message"]
    (line,) = [
        json.loads(line)
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("{") and '"event":"rpc"' in line
    ]
    assert line["status"] == "422" and line["total_ms"] >= 250
