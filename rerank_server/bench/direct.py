"""The best direct client for each backend kind, and one request through rerank-server.

Both count the pairs they did not score: a fast degraded answer is not a scored one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any

import httpx
from rerank_client import AsyncRerankClient, RerankError

from ..scoring.backends import prompt
from ..settings import DEFAULT_INSTRUCTION
from .common import SLOTS

# Both paths' limit on one call: a request, a direct batch, and rerank-server's own calls
# to the backend (`model_scenario`), so that a slow CPU fails neither path alone.
CALL_TIMEOUT_S = 120


async def _answered(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> bool:
    """One direct call: whether the backend answered it with a 2xx."""
    try:
        return (await http.post(url, json=body)).is_success
    except httpx.HTTPError:
        return False


async def _direct_chat(
    http: httpx.AsyncClient,
    url: str,
    query: str,
    docs: Sequence[str],
    slots: int = SLOTS,
    shared: asyncio.Semaphore | None = None,
) -> int:
    """The best direct strategy: every pair at once, `slots` in flight (or `shared`'s,
    a limit several direct clients hold together, as rerank-server's requests do).
    Returns how many pairs the backend did not answer."""
    limit = shared or asyncio.Semaphore(slots)

    async def one(doc: str) -> bool:
        body = {
            "messages": [
                {"role": "system", "content": prompt.SYSTEM_PROMPT},
                {"role": "user", "content": prompt.user_message(DEFAULT_INSTRUCTION, query, doc)},
            ],
            "max_tokens": 1,
            "temperature": 0.0,
            "logprobs": True,
            "top_logprobs": 20,
        }
        async with limit:
            return await _answered(http, url + "/v1/chat/completions", body)

    return sum(not ok for ok in await asyncio.gather(*(one(d) for d in docs)))


_DOCUMENT = "@@document@@"


async def rendered_prompts(
    http: httpx.AsyncClient, url: str, query: str, docs: Sequence[str]
) -> list[str]:
    """Each pair's prompt, rendered once by llama-server's own template
    (`/apply-template`)."""
    messages = [
        {"role": "system", "content": prompt.SYSTEM_PROMPT},
        {"role": "user", "content": prompt.user_message(DEFAULT_INSTRUCTION, query, _DOCUMENT)},
    ]
    rendered = (await http.post(url + "/apply-template", json={"messages": messages})).json()[
        "prompt"
    ]
    return [rendered.replace(_DOCUMENT, doc) for doc in docs]


async def _direct_completion(
    http: httpx.AsyncClient,
    url: str,
    query: str,
    docs: Sequence[str],
    slots: int,
    batch: int,
    shared: asyncio.Semaphore | None = None,
) -> int:
    """`/completion` with arrays of prompts, `batch` to a call, `slots` calls in flight,
    rendered as the `completion` backend renders them."""
    prompts = await rendered_prompts(http, url, query, docs)
    chunks = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
    return await _direct_batches(
        http,
        url,
        "/completion",
        [{"prompt": c, "n_probs": 20, "n_predict": 1, "temperature": 0.0} for c in chunks],
        [len(c) for c in chunks],
        slots,
        shared,
    )


async def _direct_batches(
    http: httpx.AsyncClient,
    url: str,
    path: str,
    bodies: Sequence[dict[str, Any]],
    pairs: Sequence[int],
    slots: int,
    shared: asyncio.Semaphore | None = None,
) -> int:
    """Batched backends, directly: every batch at once, `slots` in flight. `pairs`: how
    many pairs each body's failure loses. Returns how many the backend did not answer."""
    limit = shared or asyncio.Semaphore(slots)

    async def one(body: dict[str, Any]) -> bool:
        async with limit:
            return await _answered(http, url + path, body)

    answered = await asyncio.gather(*(one(b) for b in bodies))
    return sum(n for ok, n in zip(answered, pairs, strict=True) if not ok)


def direct_call(
    kind: str, slots: int, batch: int, shared: asyncio.Semaphore | None = None
) -> Callable[[httpx.AsyncClient, str, str, Sequence[str]], Awaitable[int]]:
    """The best direct client for a backend kind: what rerank-server is compared with.
    `shared`: one limit of `slots` for every request made through it. The call returns
    how many of its pairs the backend did not answer (a failed batch loses all of its
    pairs; a failed query embedding, every pair)."""
    if kind == "chat":
        return partial(_direct_chat, slots=slots, shared=shared)
    if kind == "completion":
        return partial(_direct_completion, slots=slots, batch=batch, shared=shared)

    async def batched(http: httpx.AsyncClient, url: str, query: str, docs: Sequence[str]) -> int:
        chunks = [list(docs[i : i + batch]) for i in range(0, len(docs), batch)]
        if kind == "embedding":  # the query once, then the documents in batches
            failed = await _direct_batches(
                http,
                url,
                "/v1/embeddings",
                [{"input": [query]}, *({"input": c} for c in chunks)],
                [len(docs), *(len(c) for c in chunks)],
                slots,
                shared,
            )
            return min(failed, len(docs))
        return await _direct_batches(
            http,
            url,
            "/v1/rerank",
            [{"query": query, "documents": c} for c in chunks],
            [len(c) for c in chunks],
            slots,
            shared,
        )

    return batched


async def through(client: AsyncRerankClient, query: str, docs: Sequence[str]) -> int:
    """One request through rerank-server: how many of its pairs were not scored. A
    degraded answer comes back fast and in retrieval order, so timing it as if scored
    would flatter rerank-server; the scenarios count such pairs and say so."""
    try:
        answer = await client.rerank(query, docs, timeout=CALL_TIMEOUT_S)
    except RerankError:
        return len(docs)
    return len(docs) - answer.summary.scored


DIRECT_KINDS = ("chat", "completion", "embedding", "rerank")
