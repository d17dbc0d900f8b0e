"""A fake `ollama` backend: Ollama's `/api/generate` (non-streamed) and `/api/version`, in
Ollama's JSON, on 127.0.0.1.

Ollama has no `/health`: that path, as every other it does not serve, is answered with
its plain-text 404.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tests.fakes.json_server import JsonFake

NOT_FOUND = b"404 page not found"


@dataclass
class FakeOllama(JsonFake):
    """An Ollama server; every field is read per request."""

    # The model's reply to the document of a prompt (a number of 0..10, or not).
    answers: Callable[[str], str] = lambda _document: "5"
    models: tuple[str, ...] = ("qwen3-reranker",)  # pulled; any other is "not found"
    version: str = "0.12.6"

    def handle(
        self, method: str, path: str, body: Any, headers: Mapping[str, str]
    ) -> tuple[int, Any]:
        if (method, path) == ("GET", "/api/version"):
            return 200, {"version": self.version}
        if (method, path) != ("POST", "/api/generate"):
            return 404, NOT_FOUND
        if body["model"] not in self.models:
            return 404, {"error": f'model "{body["model"]}" not found, try pulling it first'}
        document = body["prompt"].split("<Document>: ", 1)[1]
        return 200, {
            "model": body["model"],
            "created_at": "2026-11-22T00:00:00Z",
            "response": self.answers(document),
            "done": True,
            "done_reason": "stop",
            "total_duration": 1000,
            "eval_count": 1,
        }
