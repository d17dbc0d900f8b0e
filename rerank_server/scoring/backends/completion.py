"""`completion` backend: llama-server `/completion` with an array of prompts per call.

The template rendered once per instruction, yes/no matched by token id (docs/backends.md).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import msgspec

from ...domain import BackendKind
from ..base import Emit, Failure, ScoreRequest
from ..transport.errors import BackendCallError, MalformedResponse
from ..transport.pool import BackendPool
from . import prompt
from .batching import failed_all, score_in_batches
from .context_fit import ContextFit, token_list
from .logprobs import clamped, p_yes
from .pooled_scorer import PooledScorer

N_PROBS = 20
# Only what `_parse` reads. Without it llama-server answers every prompt with its
# settings, the prompt itself, tokens and timings, more than twice the bytes to read and
# decode (docs/decisions.md, "completion asks for only the fields it reads"). Servers
# that do not know the option ignore it.
RESPONSE_FIELDS = ["completion_probabilities", "model"]
PLACEHOLDER = "RERANK-DOCUMENT-PLACEHOLDER-7f1c"
QUERY_PLACEHOLDER = "RERANK-QUERY-PLACEHOLDER-3b9e"
FRAMES_KEPT = 64
# A rendered chat template around a query and instruction of at most 4,096 characters
# each is a few KiB; one much longer is no template (kept per instruction, 64 of them).
MAX_RENDERED_CHARS = 256 * 1024
YES_VARIANTS = ("yes", "Yes", "YES", " yes", " Yes", " YES")
NO_VARIANTS = ("no", "No", "NO", " no", " No", " NO")


class CompletionScorer(PooledScorer):
    """Batched yes/no scoring through llama-server's native completion endpoint."""

    kind = BackendKind.COMPLETION

    def __init__(
        self,
        pool: BackendPool,
        model: str = "",
        assistant_prefill: bool = True,
        max_batch: int = 32,
    ) -> None:
        super().__init__(pool, model)
        self._prefill = assistant_prefill
        self._max_batch = max_batch
        self._answer_ids: dict[int, str] | None = None
        self._fit = ContextFit(pool)
        self._variant = prompt.qwen3_variant(assistant_prefill)
        self._ids_lock = asyncio.Lock()
        # instruction -> (before the query, between query and document, after the
        # document), or None where the template must render each query itself.
        self._frames: OrderedDict[str, tuple[str, str, str] | None] = OrderedDict()

    async def answer_ids(self) -> dict[int, str]:
        """Token id -> "yes" or "no", for every single-token variant; resolved once."""
        async with self._ids_lock:
            if self._answer_ids is None:
                ids: dict[int, str] = {}
                for answer, variants in (("yes", YES_VARIANTS), ("no", NO_VARIANTS)):
                    for variant in variants:
                        tokens = await self._pool.call(
                            "/tokenize", {"content": variant}, token_list, pairs=0
                        )
                        if len(tokens) == 1:
                            ids[tokens[0]] = answer
                if "yes" not in ids.values() or "no" not in ids.values():
                    raise BackendCallError(
                        Failure.MALFORMED, "no single-token yes/no in the vocabulary"
                    )
                self._answer_ids = ids
            return self._answer_ids

    async def template(self, request: ScoreRequest) -> tuple[str, str]:
        """(prefix, suffix) of every pair's prompt for this request."""
        instruction = request.instruction
        if instruction in self._frames:
            self._frames.move_to_end(instruction)
            frame = self._frames[instruction]
        else:
            frame = _frame(*await self._render(instruction, QUERY_PLACEHOLDER))
            self._frames[instruction] = frame
            if len(self._frames) > FRAMES_KEPT:
                self._frames.popitem(last=False)
        if frame is None:
            return await self._render(instruction, request.query)
        before, between, suffix = frame
        return before + prompt.neutralize(request.query) + between, suffix

    async def _render(self, instruction: str, query: str) -> tuple[str, str]:
        """(prefix, suffix) around the document placeholder, rendered by the backend."""
        messages = [
            {"role": "system", "content": prompt.SYSTEM_PROMPT},
            {"role": "user", "content": prompt.user_message(instruction, query, PLACEHOLDER)},
        ]
        rendered = await self._pool.call(
            "/apply-template", {"messages": messages}, _rendered, pairs=0
        )
        prefix, found, suffix = rendered.partition(PLACEHOLDER)
        if not found or PLACEHOLDER in suffix:
            raise BackendCallError(
                Failure.MALFORMED, "the chat template did not keep the document in place"
            )
        return prefix, suffix + (prompt.ASSISTANT_PREFILL if self._prefill else "")

    async def score(self, request: ScoreRequest, emit: Emit) -> None:
        every = list(range(len(request.documents)))
        try:
            ids = await self.answer_ids()
            prefix, suffix = await self.template(request)
        except BackendCallError as exc:
            failed_all(every, exc, emit)
            return
        # Neutralized before they are counted: `/tokenize` reads `<|im_end|>` as one
        # token, where its neutralized text is seven, and 1,500 of them overflowed the
        # slot and failed the whole batch.
        documents = await self._fit.fit(
            [prompt.neutralize(d) for d in request.documents],
            prefix + suffix,
            request.max_tokens_per_doc,
        )
        prompts = [prefix + doc + suffix for doc in documents]

        async def batch(_start: int, chunk: Sequence[str]) -> dict[int, float | None]:
            body = self.with_model(
                {
                    "prompt": list(chunk),
                    "n_probs": N_PROBS,
                    "n_predict": 1,
                    "temperature": 0.0,
                    "cache_prompt": True,
                    "response_fields": RESPONSE_FIELDS,
                }
            )
            scores = await self._pool.call(
                "/completion",
                body,
                lambda b: self._parse(b, ids, len(chunk)),
                pairs=len(chunk),
                decode=_decode,
            )
            return dict(enumerate(scores))

        await score_in_batches(
            prompts,
            self._max_batch,
            batch,
            emit,
            split_too_long=True,
            missing="no yes/no logprob in its result",
        )

    def _parse(
        self, results: list[_Result], ids: dict[int, str], expected: int
    ) -> list[float | None]:
        """A score per result; None for a result without a usable yes/no logprob, which
        fails only its own pair (the answer as a whole is malformed only when it has the
        wrong shape or count)."""
        if len(results) != expected:
            raise MalformedResponse(f"expected {expected} completion results")
        # One server answered them all: the first result that names a model will do.
        self.note_model(next((r.model for r in results if r.model), None))
        return [_score(result, ids) for result in results]


class _Top(msgspec.Struct, gc=False):
    """One of the top logprobs (llama-server also sends its text and bytes: skipped).
    Only the answer tokens' are read: an entry of another token may lack either field,
    and an odd logprob (a string, a bool) fails its own result, not the answer."""

    id: int | None = None
    logprob: Any = None


class _Position(msgspec.Struct, gc=False):
    top_logprobs: list[_Top] | None = None


class _Result(msgspec.Struct, gc=False):
    completion_probabilities: list[_Position] | None  # required: `{"error": ...}` is none
    model: Any = None


# Only the fields read, into these types (`logprobs.decode_chat` says why). An array of
# results, or one result for a single prompt.
_RESULTS = msgspec.json.Decoder(list[_Result] | _Result)


def _decode(body: bytes) -> list[_Result]:
    """A `/completion` answer's bytes, decoded (`HttpBackend.post_json(decode=...)`):
    MalformedResponse for JSON of the wrong shape, msgspec.DecodeError for not JSON."""
    try:
        decoded = _RESULTS.decode(body)
    except msgspec.ValidationError as exc:
        raise MalformedResponse(f"completion answer of the wrong shape ({exc})") from None
    return decoded if isinstance(decoded, list) else [decoded]


def _score(result: _Result, ids: dict[int, str]) -> float | None:
    """P(yes) from the answer tokens among the first position's top logprobs; None when
    neither is there, or one has no number for its logprob."""
    positions = result.completion_probabilities
    top = positions[0].top_logprobs if positions else None
    if top is None:
        return None
    answers = []
    for entry in top:
        answer = ids.get(entry.id)  # type: ignore[arg-type]  # None is no key
        if answer is not None:
            logprob = entry.logprob
            # Numbers only: not a bool (an int to Python), a string, NaN, or an integer
            # too large for a float (JSON allows 400 digits).
            if type(logprob) is int:
                logprob = float(logprob) if -1e300 < logprob < 1e300 else None
            if type(logprob) is not float or logprob != logprob:
                return None
            answers.append((answer, clamped(logprob)))
    return p_yes(answers)


def _frame(prefix: str, suffix: str) -> tuple[str, str, str] | None:
    """The rendering split around its query placeholder, if the placeholder is in the
    prefix exactly once (a template may transform or repeat the user's message)."""
    before, found, between = prefix.partition(QUERY_PLACEHOLDER)
    if not found or QUERY_PLACEHOLDER in between or QUERY_PLACEHOLDER in suffix:
        return None
    return before, between, suffix


def _rendered(body: Any) -> str:
    text = body.get("prompt") if isinstance(body, dict) else None
    if not isinstance(text, str):
        raise MalformedResponse("/apply-template answer has no prompt")
    if len(text) > MAX_RENDERED_CHARS:  # kept per instruction: bounded, as the query is
        raise MalformedResponse(
            f"/apply-template answer longer than {MAX_RENDERED_CHARS} characters"
        )
    return text
