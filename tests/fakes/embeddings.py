"""A fake `embedding` backend: an OpenAI-style `/v1/embeddings` (as llama-server, vLLM and
TEI serve it), in their JSON, on 127.0.0.1.

Vectors come as base64 of little-endian float32s when the call asks for it with
`encoding_format` (OpenAI's option), or as floats: from a backend that ignores the option,
or refuses it with a 400 as vLLM did until mid-2024. An input longer than llama-server's
physical batch gets its 500. It serves `GET /health`; any other path (`/tokenize`, `/props`
included) is answered 404.
"""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from tests.fakes.json_server import JsonFake

Answer = tuple[int, Any]


def leaning(text: str) -> list[float]:
    """A vector leaning one way for texts holding "relevant", the other way for the rest."""
    lean = 0.9 if "relevant" in text else 0.1
    return [lean, 1 - lean, 0.25]


def as_base64(values: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()


@dataclass
class FakeEmbeddings(JsonFake):
    """An OpenAI-style embeddings server; every field is read per request."""

    vector_of: Callable[[str], list[float]] = leaning
    # Asked for base64: "answer" in base64, "ignore" the option (floats), or "refuse" it.
    base64: Literal["answer", "ignore", "refuse"] = "answer"
    reverse: bool = False  # the entries of `data` in reverse order
    nan_for: str = ""  # a NaN in the vectors of texts holding this (only base64 carries one)
    # Entry n (by position) claims this text `index` instead of its own.
    claimed_index: dict[int, int] = field(default_factory=dict)
    # Every entry's `embedding` is this value instead of the vector, when set.
    embedding: Any = None
    # llama-server's physical batch (`-ub`), here in bytes standing for tokens: a longer
    # input is refused with its 500, naming the batch where `names_batch`.
    physical_batch: int | None = None
    names_batch: bool = True
    # An answer sent in place of the vectors for a call's body, or None for the vectors.
    instead: Callable[[Any], Answer | None] = lambda _body: None

    def handle(self, method: str, path: str, body: Any, headers: Mapping[str, str]) -> Answer:
        if (method, path) == ("GET", "/health"):
            return 200, {"status": "ok"}
        if (method, path) != ("POST", "/v1/embeddings"):
            return 404, {}
        instead = self.instead(body)
        if instead is not None:
            return instead
        texts: list[str] = body["input"]
        limit = self.physical_batch
        if limit is not None and any(len(text.encode()) > limit for text in texts):
            where = f" (current batch size: {limit})" if self.names_batch else ""
            return 500, {
                "error": {
                    "code": 500,
                    "type": "server_error",
                    "message": "input (400 tokens) is too large to process. increase "
                    f"the physical batch size{where}",
                }
            }
        wants_base64 = body.get("encoding_format") == "base64" and self.base64 != "ignore"
        if wants_base64 and self.base64 == "refuse":
            return 400, {
                "object": "error",
                "type": "BadRequestError",
                "code": 400,
                "message": "base64 encoding is not currently supported",
            }
        data = []
        for i, text in enumerate(texts):
            values = list(self.vector_of(text))
            if self.nan_for and self.nan_for in text:
                values[0] = math.nan
            embedding = as_base64(values) if wants_base64 else values
            data.append(
                {
                    "object": "embedding",
                    "index": self.claimed_index.get(i, i),
                    "embedding": embedding if self.embedding is None else self.embedding,
                }
            )
        if self.reverse:
            data.reverse()
        return 200, {"object": "list", "data": data, "model": "minilm"}
