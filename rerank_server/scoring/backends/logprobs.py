"""P(yes) from the top logprobs of a yes/no answer token."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import msgspec

from ..transport.errors import MalformedResponse

FLOOR_LOGPROB = -10.0
MIN_LOGPROB = -1e4


class MalformedLogprobs(MalformedResponse):
    """The backend's answer has no usable logprobs."""


def _logsumexp(values: list[float]) -> float:
    if len(values) == 1:  # one variant of the answer, the usual case
        return values[0]
    top = max(values)
    return top + math.log(sum([math.exp(v - top) for v in values]))


def p_yes(top_logprobs: Iterable[tuple[str, float]]) -> float | None:
    """P(yes) from (token, logprob) pairs, or None when neither answer is present.

    The softmax over the "yes" and "no" logprobs; tokens match whatever their case and
    surrounding whitespace, and variants of one answer are pooled (log-sum-exp). An
    answer missing from the list gets `FLOOR_LOGPROB` (Qwen3-Reranker's recipe), or the
    lowest logprob listed if lower: it is no likelier than the last one listed.
    """
    yes: list[float] = []
    no: list[float] = []
    floor = FLOOR_LOGPROB
    for token, logprob in top_logprobs:
        floor = min(floor, logprob)
        word = token.strip().lower()
        if word == "yes":
            yes.append(logprob)
        elif word == "no":
            no.append(logprob)
    if not yes and not no:
        return None
    ly = _logsumexp(yes) if yes else floor
    ln = _logsumexp(no) if no else floor
    # Softmax of two values = sigmoid of their difference, in a form that cannot overflow.
    d = ly - ln
    if d >= 0:
        return 1.0 / (1.0 + math.exp(-d))
    e = math.exp(d)
    return e / (1.0 + e)


class _Top(msgspec.Struct, gc=False):
    """One of the top logprobs (llama-server also sends its id and bytes: skipped)."""

    token: str
    logprob: float


# Only the path read must be there (`chat_top_logprobs` checks it): a second choice or
# position without logprobs does not spoil the first.
class _Position(msgspec.Struct, gc=False):
    top_logprobs: list[_Top] | None = None


class _Logprobs(msgspec.Struct, gc=False):
    content: list[_Position] | None = None


class _Choice(msgspec.Struct, gc=False):
    logprobs: _Logprobs | None = None


class ChatAnswer(msgspec.Struct, gc=False):
    """The fields read of an OpenAI chat answer: its choices' logprobs, and the model."""

    choices: list[_Choice]
    model: Any = None


# Decodes only the fields read, into these types: about half of what decoding the whole
# answer into dicts costs (each of the 20 entries carries a list of bytes), and a string,
# a bool or null where a number belongs is an error, not a score. `gc=False`: decoded
# JSON holds no reference cycles, and structs the collector does not track are about a
# fifth cheaper to make.
_CHAT = msgspec.json.Decoder(ChatAnswer)


def decode_chat(body: bytes) -> ChatAnswer:
    """An OpenAI chat answer's bytes, decoded (`HttpBackend.post_json(decode=...)`).

    Raises MalformedLogprobs for JSON of the wrong shape, msgspec.DecodeError for bytes
    that are not JSON."""
    try:
        return _CHAT.decode(body)
    except msgspec.ValidationError as exc:
        raise MalformedLogprobs(f"no top_logprobs in chat response ({exc})") from None


def chat_top_logprobs(answer: ChatAnswer) -> list[tuple[str, float]]:
    """(token, logprob) pairs of the first generated token of an OpenAI chat answer.

    Shape: `choices[0].logprobs.content[0].top_logprobs[] = {token, logprob, ...}`.
    Raises MalformedLogprobs when the shape is not there.
    """
    choice = answer.choices[0] if answer.choices else None
    content = choice.logprobs.content if choice and choice.logprobs else None
    top = content[0].top_logprobs if content else None
    if top is None:
        raise MalformedLogprobs("no top_logprobs in chat response")
    return [(e.token, clamped(e.logprob)) for e in top]


def clamped(logprob: float) -> float:
    """-inf (probability 0) and the like would turn the softmax into NaN: anything below
    `MIN_LOGPROB` becomes it, which is 0 as well."""
    return logprob if logprob > MIN_LOGPROB else MIN_LOGPROB
