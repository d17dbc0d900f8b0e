"""`chat` backend: one llama-server `/v1/chat/completions` call per pair, yes/no logprobs.

The request is the Qwen3-Reranker prompt (system, user turn with `<Instruct>`, `<Query>`,
`<Document>`, and optionally the empty think block as an assistant prefill), asking for
one token at temperature 0 with the top 20 logprobs. The score is P(yes)
(`logprobs.p_yes`).
"""

from __future__ import annotations

from typing import Any

from ..domain import BackendKind
from . import prompt
from .backend_pool import BackendPool, MalformedResponse
from .base import Emit, PairOutcome, ScoreRequest
from .batching import map_pairs
from .http import BackendCallError
from .logprobs import MalformedLogprobs, chat_top_logprobs, p_yes
from .pooled_scorer import PooledScorer

TOP_LOGPROBS = 20


class ChatScorer(PooledScorer):
    """Scores pairs through an OpenAI-compatible chat endpoint with logprobs."""

    kind = BackendKind.CHAT

    def __init__(self, pool: BackendPool, model: str = "",
                 assistant_prefill: bool = True) -> None:
        super().__init__(pool, model)
        self._prefill = assistant_prefill

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
        return self.with_model(body)

    def _parse(self, body: Any) -> float:
        try:
            score = p_yes(chat_top_logprobs(body))
        except MalformedLogprobs as exc:
            raise MalformedResponse(str(exc)) from None
        if isinstance(body, dict):
            self.note_model(body.get("model"))
        if score is None:
            raise MalformedResponse("no yes/no token in top logprobs")
        return score

    async def score(self, request: ScoreRequest, emit: Emit) -> None:
        async def one(i: int) -> PairOutcome:
            try:
                score = await self._pool.call("/v1/chat/completions",
                                              self.payload(request, request.documents[i]),
                                              self._parse)
            except BackendCallError as exc:
                return PairOutcome.failed(i, exc.failure, exc.detail)
            return PairOutcome(i, score)

        await map_pairs(len(request.documents), one, emit)

