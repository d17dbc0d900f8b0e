"""A fake `completion` backend: llama-server's `/completion` family (`/tokenize`,
`/apply-template`, `/completion` with `n_probs`), in llama-server's JSON, on 127.0.0.1.

It stands for a model whose chat template the real stand-in model does not have: the
template may repeat the user's instruction and query above the turn. "yes" and "no" are
tokens 1 and 2, and every prompt's first token has them as its top logprobs. It serves
`GET /health`; any other path is answered 404, as llama-server does. (llama-server's
`/v1/chat/completions` is `tests/fakes/llama.py`.)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tests.fakes.json_server import JsonFake

Answer = tuple[int, Any]
YES, NO = 1, 2  # the token ids of "yes" and "no"


@dataclass
class FakeLlamaCompletion(JsonFake):
    """llama-server serving `/completion` with a chat template; fields are read per request."""

    # The template puts `[<instruction and query>]` above the system turn.
    repeats_query: bool = False
    # The logprobs of "yes" and of "no" for a prompt (any JSON value, to test decoding).
    logprobs_of: Callable[[str], tuple[Any, Any]] = lambda _prompt: (-0.1, -2.4)
    # An answer sent in place of a `/completion` call's for its body (a refusal, bytes that
    # are not JSON), or None for the logprobs.
    instead: Callable[[Any], Answer | None] = lambda _body: None

    def handle(self, method: str, path: str, body: Any, headers: Mapping[str, str]) -> Answer:
        if (method, path) == ("GET", "/health"):
            return 200, {"status": "ok"}
        if method != "POST":
            return 404, {"message": "not found"}
        if path == "/tokenize":
            return 200, {"tokens": {"yes": [YES], "no": [NO]}.get(body["content"], [3, 4])}
        if path == "/apply-template":
            system, user = (m["content"] for m in body["messages"])
            rendered = f"<sys>{system}</sys>\n<u>{user}</u>\n<a>"
            if self.repeats_query:
                rendered = "[" + user.split("\n<Document>")[0] + "]\n" + rendered
            return 200, {"prompt": rendered}
        if path == "/completion":
            instead = self.instead(body)
            return instead if instead is not None else (200, self._completion(body))
        return 404, {"message": "not found"}

    def _completion(self, body: Any) -> list[dict[str, Any]]:
        answers = []
        for prompt in body["prompt"]:
            yes, no = self.logprobs_of(prompt)
            top = [{"id": YES, "logprob": yes}, {"id": NO, "logprob": no}]
            answers.append({"completion_probabilities": [{"top_logprobs": top}]})
        return answers
