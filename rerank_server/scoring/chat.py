"""`chat` backend: one llama-server `/v1/chat/completions` call per pair, yes/no logprobs.

The request is the Qwen3-Reranker prompt (system, user turn with `<Instruct>`, `<Query>`,
`<Document>`, and optionally the empty think block as an assistant prefill), asking for
one token at temperature 0 with the top 20 logprobs. The score is P(yes)
(`logprobs.p_yes`).
"""

from __future__ import annotations

from typing import Any

from .. import prompt
from .base import Emit, Failure, PairOutcome, ScoreRequest
from .http import BackendCallError, HttpBackend
from .logprobs import MalformedLogprobs, chat_top_logprobs, p_yes

TOP_LOGPROBS = 20


class ChatScorer:
    """Scores pairs through an OpenAI-compatible chat endpoint with logprobs."""

    kind = "chat"

    def __init__(self, http: HttpBackend, model: str = "", assistant_prefill: bool = True) -> None:
        self._http = http
        self._configured_model = model
        self._reported_model = ""
        self._prefill = assistant_prefill

    @property
    def model(self) -> str:
        return self._configured_model or self._reported_model

    async def discover_model(self) -> None:
        if self._configured_model:
            return
        body = await self._http.get_json("/v1/models")
        data = body.get("data") if isinstance(body, dict) else None
        if isinstance(data, list) and data and isinstance(data[0], dict) \
                and isinstance(data[0].get("id"), str):
            self._reported_model = _model_name(data[0]["id"])

    def payload(self, request: ScoreRequest, document: str) -> dict[str, Any]:
        messages = [
            {"role": "system", "content": prompt.SYSTEM_PROMPT},
            {"role": "user", "content": prompt.user_message(request.instruction, request.query,
                                                            document)},
        ]
        if self._prefill:
            messages.append({"role": "assistant", "content": prompt.ASSISTANT_PREFILL})
        body: dict[str, Any] = {
            "messages": messages,
            "max_tokens": 1,
            "temperature": 0.0,
            "logprobs": True,
            "top_logprobs": TOP_LOGPROBS,
        }
        if self._configured_model:
            body["model"] = self._configured_model
        return body

    async def score(self, request: ScoreRequest, emit: Emit) -> None:
        async def one(i: int) -> PairOutcome:
            try:
                body = await self._http.post_json("/v1/chat/completions",
                                                  self.payload(request, request.documents[i]))
                score = p_yes(chat_top_logprobs(body))
            except BackendCallError as exc:
                return PairOutcome.failed(i, exc.failure, exc.detail)
            except MalformedLogprobs as exc:
                self._http.record_malformed()
                return PairOutcome.failed(i, Failure.MALFORMED, str(exc))
            if isinstance(body, dict) and isinstance(body.get("model"), str):
                self._reported_model = _model_name(body["model"])
            if score is None:
                self._http.record_malformed()
                return PairOutcome.failed(i, Failure.MALFORMED, "no yes/no token in top logprobs")
            return PairOutcome(i, score)

        await self._http.map_pairs(len(request.documents), one, emit)

    async def aclose(self) -> None:
        await self._http.aclose()


def _model_name(reported: str) -> str:
    """llama-server reports the model's file path; callers need only its name."""
    return reported.rsplit("/", 1)[-1]
