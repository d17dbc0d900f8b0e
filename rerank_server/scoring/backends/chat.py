"""`chat` backend: one llama-server `/v1/chat/completions` call per pair, yes/no logprobs.

The Qwen3-Reranker prompt (`prompt.py`), one token at temperature 0, P(yes) (`logprobs.py`).
"""

from __future__ import annotations

from typing import Any

from ...domain import BackendKind
from ..base import Emit, PairOutcome, ScoreRequest
from ..transport.errors import BackendCallError, MalformedResponse
from ..transport.pool import BackendPool
from . import prompt
from .batching import map_pairs
from .context_fit import ContextFit, shorter
from .logprobs import ChatAnswer, chat_top_logprobs, decode_chat, p_yes
from .pooled_scorer import PooledScorer

TOP_LOGPROBS = 20


class ChatScorer(PooledScorer):
    """Scores pairs through an OpenAI-compatible chat endpoint with logprobs."""

    kind = BackendKind.CHAT

    def __init__(self, pool: BackendPool, model: str = "", assistant_prefill: bool = True) -> None:
        super().__init__(pool, model)
        self._prefill = assistant_prefill
        self._fit = ContextFit(pool)
        self._variant = prompt.qwen3_variant(assistant_prefill)

    def payload(self, request: ScoreRequest, document: str) -> dict[str, Any]:
        messages = [
            {"role": "system", "content": prompt.SYSTEM_PROMPT},
            {
                "role": "user",
                "content": prompt.user_message(request.instruction, request.query, document),
            },
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

    def _parse(self, answer: ChatAnswer) -> float:
        top = chat_top_logprobs(answer)  # MalformedLogprobs is a MalformedResponse
        self.note_model(answer.model)
        score = p_yes(top)
        if score is None:
            raise MalformedResponse("no yes/no token in top logprobs")
        return score

    def around(self, request: ScoreRequest) -> str:
        """The prompt text besides the document, for the context budget."""
        return (
            prompt.SYSTEM_PROMPT
            + prompt.user_message(request.instruction, request.query, "")
            + (prompt.ASSISTANT_PREFILL if self._prefill else "")
        )

    async def score(self, request: ScoreRequest, emit: Emit) -> None:
        # Neutralized before they are counted, as they will be sent (`completion.py`).
        documents = await self._fit.fit(
            [prompt.neutralize(d) for d in request.documents],
            self.around(request),
            request.max_tokens_per_doc,
        )

        async def one(i: int) -> PairOutcome:
            document = documents[i]
            for last_try in (False, True):
                try:
                    score = await self._pool.call(
                        "/v1/chat/completions",
                        self.payload(request, document),
                        self._parse,
                        decode=decode_chat,
                    )
                except BackendCallError as exc:
                    if exc.too_long and not last_try:
                        document = shorter(document)
                        continue
                    return PairOutcome.failed(i, exc.failure, exc.detail)
                return PairOutcome(i, score)
            raise AssertionError("unreachable")

        await map_pairs(len(documents), one, emit, self.calls)
