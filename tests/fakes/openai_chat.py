"""A fake `llm` backend: an OpenAI-style `/v1/chat/completions` that answers a listwise
prompt with text, in OpenAI's JSON, on 127.0.0.1.

The candidates are read from the user turn (`[n] text` lines) and handed to `content`,
which writes the model's reply. A wrong API key gets OpenAI's 401. It serves `GET
/health` as well; any other path is answered 404. (llama-server's chat with logprobs,
the `chat` backend, is `tests/fakes/llama.py`.)
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tests.fakes.json_server import JsonFake

_CANDIDATE = re.compile(r"^\[(\d+)\] (.*)$", flags=re.MULTILINE)


@dataclass
class FakeOpenAiChat(JsonFake):
    """An OpenAI-style chat server; every field is read per request."""

    # The assistant's reply, from the candidates' texts in the prompt's order.
    content: Callable[[list[str]], str] = lambda _texts: "[]"
    api_key: str = "good"  # the one key accepted (`Authorization: Bearer <key>`)

    def handle(
        self, method: str, path: str, body: Any, headers: Mapping[str, str]
    ) -> tuple[int, Any]:
        if (method, path) == ("GET", "/health"):
            return 200, {"status": "ok"}
        if (method, path) != ("POST", "/v1/chat/completions"):
            return 404, {}
        if headers.get("authorization") != f"Bearer {self.api_key}":
            return 401, {
                "error": {
                    "message": "Incorrect API key provided.",
                    "type": "invalid_request_error",
                    "code": "invalid_api_key",
                }
            }
        user = body["messages"][1]["content"]
        texts = [text for _, text in _CANDIDATE.findall(user)]
        return 200, {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "model": body["model"],
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop",
                    "message": {"role": "assistant", "content": self.content(texts)},
                }
            ],
            "usage": {"prompt_tokens": 100, "completion_tokens": 20},
        }
