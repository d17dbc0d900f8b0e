"""The ecosystem's clients, unmodified and with their defaults, against the JSON API of a
server with its default blend and a real model (MiniLM-L6 through llama-server): each
on the needle case, where retrieval put the two on-topic documents last but two. The
on-topic document must come first (docs/http.md).

The clients are the `ecosystem` extra (`make test` installs it): the official Cohere SDK
(v1, v2), LangChain's `CohereRerank`, LlamaIndex's Cohere postprocessor, LiteLLM's
`cohere/`, `infinity/`, `hosted_vllm/` and `huggingface/` providers, and Haystack's TEI
ranker.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rerank_server.managed.child_process import free_port
from rerank_server.server import RunningServer
from tests.conftest import StartServer
from tests.real.conftest import RealLlama

# LiteLLM fetches its model price list from the internet at import unless told not to.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

QUERY = "how do i reset my router password"
DOCS = [
    "Router firmware update guide: download the latest firmware from the vendor's site.",
    "Password manager comparison: the best apps to store all of your passwords.",
    "How to cook rice: rinse the grains, then simmer them for eighteen minutes.",
    "Wi-Fi channel selection explained for crowded apartment buildings.",
    "Choosing a strong password: length matters more than symbols.",
    "Network switch or router: what is the difference between them?",
    "Reset your phone to factory settings from the recovery menu.",
    "To reset the router's admin password, hold its reset button for 30 seconds, then "
    "log in with the default password printed on the label.",
    "Forgot your router password? Open the router page at 192.168.1.1 and choose Change "
    "password under Administration.",
    "The best hiking trails in the Alps for beginners.",
]
ON_TOPIC = {7, 8}
KEY = "unused-on-loopback"

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::PendingDeprecationWarning", "ignore::UserWarning"
)


@pytest.fixture(autouse=True, scope="module")
def logging_as_it_was() -> Iterator[None]:
    """The clients change the process's logging for the tests after them (LiteLLM puts a
    filter on uvicorn's loggers that rewrites records): put back what they found."""
    manager = logging.Logger.manager
    before = {
        name: (list(lg.filters), list(lg.handlers))
        for name, lg in [("", logging.getLogger()), *manager.loggerDict.items()]
        if isinstance(lg, logging.Logger)
    }
    yield
    for name, lg in [("", logging.getLogger()), *manager.loggerDict.items()]:
        if isinstance(lg, logging.Logger):
            lg.filters[:], lg.handlers[:] = before.get(name, ([], []))


@pytest.fixture(autouse=True)
def clients_connections_collected() -> Iterator[None]:
    """Some clients under test never close their HTTP connections (the Cohere SDK's
    `Client` is dropped with its httpx client open, in a reference cycle): collected
    here, their ResourceWarnings theirs, not a later test's (warnings are errors)."""
    yield
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


@pytest.fixture(params=["one model", "two models"])
async def server(
    request: pytest.FixtureRequest,
    start_server: StartServer,
    real_embedding: RealLlama,
    tmp_path: Path,
) -> RunningServer:
    """One model, any name accepted; or two, MiniLM the operator's default, which the
    clients' own model names ("rerank-v3.5", ...) reach."""
    if request.param == "one model":
        running = await start_server(
            backend="embedding", backend_url=real_embedding.url, http_port=free_port()
        )
    else:
        real_rank_head: RealLlama = request.getfixturevalue("real_rank_head")
        models = tmp_path / "models.toml"
        models.write_text(
            'default = "minilm"\n'
            f'[models.minilm]\nsource = "{real_embedding.url}"\nbackend = "embedding"\n'
            f'[models.untrained]\nsource = "{real_rank_head.url}"\nbackend = "rerank"\n'
        )
        running = await start_server(models_file=str(models), http_port=free_port())
        assert running.models.names == ["minilm", "untrained"]
    await asyncio.wait_for(running.monitor.ready.wait(), 30)  # the model's name is known
    return running


def url(server: RunningServer) -> str:
    return f"http://127.0.0.1:{server.http_port}"


def cohere_v1(base: str) -> int:
    import cohere

    answer = cohere.Client(api_key=KEY, base_url=base).rerank(
        model="rerank-english-v3.0", query=QUERY, documents=DOCS
    )
    return int(answer.results[0].index)


def cohere_v2(base: str) -> int:
    import cohere

    answer = cohere.ClientV2(api_key=KEY, base_url=base).rerank(
        model="rerank-v3.5", query=QUERY, documents=DOCS
    )
    return int(answer.results[0].index)


def langchain(base: str) -> int:
    from langchain_cohere import CohereRerank
    from langchain_core.documents import Document

    reranker = CohereRerank(cohere_api_key=KEY, base_url=base, model="rerank-v3.5")
    top = reranker.compress_documents([Document(page_content=d) for d in DOCS], QUERY)
    return DOCS.index(top[0].page_content)


def llama_index(base: str) -> int:
    from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
    from llama_index.postprocessor.cohere_rerank import CohereRerank

    reranker = CohereRerank(api_key=KEY, base_url=base, model="rerank-v3.5")
    nodes = [NodeWithScore(node=TextNode(text=d)) for d in DOCS]
    top = reranker.postprocess_nodes(nodes, QueryBundle(QUERY))
    return DOCS.index(top[0].node.get_content())


def litellm_provider(model: str) -> Callable[[str], int]:
    def call(base: str) -> int:
        import litellm

        answer = litellm.rerank(
            model=model, query=QUERY, documents=DOCS, api_base=base, api_key=KEY
        )
        return int(answer.results[0]["index"])

    return call


def haystack(base: str) -> int:
    from haystack import Document
    from haystack_integrations.components.rankers.huggingface_api import HuggingFaceTEIRanker

    ranker = HuggingFaceTEIRanker(url=base, top_k=3)
    top = ranker.run(query=QUERY, documents=[Document(content=d) for d in DOCS])["documents"]
    return DOCS.index(top[0].content)


CLIENTS: dict[str, Callable[[str], int]] = {
    "cohere-v1": cohere_v1,
    "cohere-v2": cohere_v2,
    "langchain": langchain,
    "llama-index": llama_index,
    "litellm-cohere": litellm_provider("cohere/rerank-v3.5"),
    "litellm-infinity": litellm_provider("infinity/rerank"),
    "litellm-hosted-vllm": litellm_provider("hosted_vllm/reranker"),
    "litellm-huggingface": litellm_provider("huggingface/BAAI/bge-reranker-base"),
    "haystack-tei": haystack,
}


@pytest.mark.parametrize("client", list(CLIENTS))
async def test_each_client_gets_the_on_topic_document_first(
    server: RunningServer, client: str
) -> None:
    first: Any = await asyncio.to_thread(CLIENTS[client], url(server))
    assert first in ON_TOPIC, f"{client} put document {first} first: {DOCS[first]!r}"
