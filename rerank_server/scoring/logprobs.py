"""P(yes) from the top logprobs of a yes/no answer token.

The score is the softmax over the "yes" and "no" logprobs, i.e.
P(yes) = e^yes / (e^yes + e^no). Tokens match without regard to case or surrounding
whitespace ("Yes", " yes", "YES"); several variants of one answer are pooled with
log-sum-exp. When only one answer appears in the top logprobs the other gets the floor
logprob -10 (as in Qwen3-Reranker's own logprob recipe). When neither appears the pair
has no score: no invented constant.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

FLOOR_LOGPROB = -10.0
MIN_LOGPROB = -1e4


class MalformedLogprobs(ValueError):
    """The backend's answer has no usable logprobs."""


def _logsumexp(values: list[float]) -> float:
    if len(values) == 1:  # one variant of the answer, the usual case
        return values[0]
    top = max(values)
    return top + math.log(sum([math.exp(v - top) for v in values]))


def p_yes(top_logprobs: Iterable[tuple[str, float]]) -> float | None:
    """P(yes) from (token, logprob) pairs, or None when neither answer is present."""
    yes: list[float] = []
    no: list[float] = []
    for token, logprob in top_logprobs:
        word = token.strip().lower()
        if word == "yes":
            yes.append(logprob)
        elif word == "no":
            no.append(logprob)
    if not yes and not no:
        return None
    ly = _logsumexp(yes) if yes else FLOOR_LOGPROB
    ln = _logsumexp(no) if no else FLOOR_LOGPROB
    # Softmax of two values = sigmoid of their difference, in a form that cannot overflow.
    d = ly - ln
    if d >= 0:
        return 1.0 / (1.0 + math.exp(-d))
    e = math.exp(d)
    return e / (1.0 + e)


def chat_top_logprobs(body: Any) -> list[tuple[str, float]]:
    """(token, logprob) pairs of the first generated token of an OpenAI chat response.

    Shape: `choices[0].logprobs.content[0].top_logprobs[] = {token, logprob, ...}`.
    Raises MalformedLogprobs when the shape is not there.
    """
    try:
        content = body["choices"][0]["logprobs"]["content"]
        entries = content[0]["top_logprobs"]
        out = []
        for e in entries:
            token = e["token"]
            if not isinstance(token, str):
                raise TypeError("bad top_logprobs entry")
            out.append((token, checked_logprob(e["logprob"])))
        return out
    except (KeyError, IndexError, TypeError) as exc:
        raise MalformedLogprobs(
            f"no top_logprobs in chat response ({type(exc).__name__})") from None


def checked_logprob(value: Any) -> float:
    """`value` as a logprob; TypeError unless it is a number (not a bool) and not NaN.
    -inf (probability 0) would turn the softmax into NaN: it becomes `MIN_LOGPROB`, which
    is 0 as well."""
    if type(value) is not float:  # exactly float, the common case, checks least
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise TypeError("bad logprob")
        value = float(value)
    if value != value:
        raise TypeError("NaN logprob")
    return value if value > MIN_LOGPROB else MIN_LOGPROB
