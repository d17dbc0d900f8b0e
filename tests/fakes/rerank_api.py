"""A fake `rerank` backend: Cohere's `/v1/rerank` (as llama-server and vLLM serve it) or
TEI's `/rerank`, in their JSON, on 127.0.0.1.

Cohere's shape: `{query, documents, top_n, model}` in, `results[]` of `{index,
relevance_score}` out, best first, cut to `top_n`. TEI's: `{query, texts}` in, a bare list
of `{index, score}` out, and a 413 for a call over its `--max-client-batch-size`. Both
serve `GET /health`; any other path is answered 404.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from tests.fakes.json_server import JsonFake

Answer = tuple[int, Any]


@dataclass
class FakeRerankApi(JsonFake):
    """A Cohere- or TEI-style rerank server; every field is read per request."""

    format: Literal["cohere", "tei"] = "cohere"
    # The score of a document: Cohere's relevance_score, or TEI's score (a logit or not).
    score_of: Callable[[str], float] = lambda _document: 0.5
    latency_s: float = 0.0  # before each scoring call is answered
    # TEI's `--max-client-batch-size`: a call with more texts is refused with TEI's 413.
    max_client_batch: int | None = None
    # An answer sent in place of the scores for a call's body (a refusal, a proxy's page,
    # odd entries), or None for the scores.
    instead: Callable[[Any], Answer | None] = lambda _body: None

    @property
    def path(self) -> str:
        return "/rerank" if self.format == "tei" else "/v1/rerank"

    def handle(self, method: str, path: str, body: Any, headers: Mapping[str, str]) -> Answer:
        if (method, path) == ("GET", "/health"):
            return 200, (b"" if self.format == "tei" else {"status": "ok"})
        if (method, path) != ("POST", self.path):
            return 404, (b"" if self.format == "tei" else {"message": "not found"})
        time.sleep(self.latency_s)
        instead = self.instead(body)
        if instead is not None:
            return instead
        return self._tei(body) if self.format == "tei" else self._cohere(body)

    def _cohere(self, body: Any) -> Answer:
        if not body.get("documents"):
            return 400, {"message": "invalid request: list of documents must not be empty"}
        results = sorted(
            (
                {"index": i, "relevance_score": self.score_of(d)}
                for i, d in enumerate(body["documents"])
            ),
            key=lambda r: -r["relevance_score"],
        )
        return 200, {
            "id": "r-1",
            "results": results[: body["top_n"]],
            "meta": {"billed_units": {"search_units": 1}},
        }

    def _tei(self, body: Any) -> Answer:
        texts = body["texts"]
        if self.max_client_batch is not None and len(texts) > self.max_client_batch:
            return 413, {
                "error": f"batch size {len(texts)} > maximum allowed batch size "
                f"{self.max_client_batch}",
                "error_type": "Validation",
            }
        return 200, sorted(
            ({"index": i, "score": self.score_of(t)} for i, t in enumerate(texts)),
            key=lambda r: -r["score"],
        )
