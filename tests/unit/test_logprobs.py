"""P(yes) from top logprobs: both tokens, one missing, none, variants, malformed shapes."""

from __future__ import annotations

import math

import msgspec
import orjson
import pytest

from rerank_server.scoring.backends.logprobs import (
    FLOOR_LOGPROB,
    MalformedLogprobs,
    chat_top_logprobs,
    decode_chat,
    p_yes,
)


def _top(body: object) -> list[tuple[str, float]]:
    return chat_top_logprobs(decode_chat(orjson.dumps(body)))


def test_softmax_of_yes_and_no() -> None:
    assert p_yes([("yes", math.log(0.3)), ("no", math.log(0.6))]) == pytest.approx(1 / 3)


def test_case_and_whitespace_variants_are_pooled() -> None:
    p = p_yes([(" Yes", math.log(0.2)), ("yes", math.log(0.2)), ("NO ", math.log(0.4))])
    assert p == pytest.approx(0.5)


def test_missing_no_gets_floor() -> None:
    expected = 1 / (1 + math.exp(FLOOR_LOGPROB - math.log(0.4)))
    assert p_yes([("yes", math.log(0.4)), ("The", -0.1)]) == pytest.approx(expected)


def test_missing_yes_gets_floor() -> None:
    assert p_yes([("no", -0.01)]) == pytest.approx(1 / (1 + math.exp(-0.01 - FLOOR_LOGPROB)))


def test_a_missing_answer_is_no_likelier_than_the_last_listed() -> None:
    """ "no" at -12 is listed, "yes" is not: yes is at most -12 too, not the floor's -10
    (which scored the pair 0.88, above one where yes was listed)."""
    assert p_yes([("The", -0.01), ("no", -12.0)]) == pytest.approx(0.5)
    assert p_yes([("The", -0.01), ("no", -12.0), ("x", -15.0)]) == pytest.approx(
        1 / (1 + math.exp(3.0))
    )


def test_neither_token_is_unscored_not_a_constant() -> None:
    assert p_yes([("The", -0.1), ("Here", -2.0)]) is None
    assert p_yes([]) is None


def test_extreme_logprobs_do_not_overflow() -> None:
    assert p_yes([("yes", -5000.0), ("no", 0.0)]) == pytest.approx(0.0)
    assert p_yes([("yes", 0.0), ("no", -5000.0)]) == pytest.approx(1.0)


def _chat(top: object) -> dict[str, object]:
    return {
        "choices": [{"logprobs": {"content": [{"token": "x", "logprob": 0, "top_logprobs": top}]}}]
    }


def test_chat_shape_parsed() -> None:
    body = _chat(
        [
            {"id": 1, "token": "yes", "bytes": [121, 101, 115], "logprob": -0.5},
            {"id": 2, "token": "no", "bytes": [110, 111], "logprob": -3},
        ]
    )
    answer = decode_chat(orjson.dumps({**body, "model": "m.gguf"}))
    assert chat_top_logprobs(answer) == [("yes", -0.5), ("no", -3.0)]
    assert answer.model == "m.gguf"


def test_only_the_first_choice_and_position_must_have_logprobs() -> None:
    body = _chat([{"token": "yes", "logprob": -0.5}])
    body["choices"].append({"logprobs": None})  # type: ignore[attr-defined]
    assert _top(body) == [("yes", -0.5)]


def test_a_vanishing_logprob_is_clamped() -> None:
    # JSON has no -inf; a number too small to matter stands for it.
    pairs = _top(_chat([{"token": "no", "logprob": -1e300}, {"token": "yes", "logprob": -1.0}]))
    assert pairs[0] == ("no", -1e4)
    assert p_yes(pairs) == pytest.approx(1.0)


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"choices": []},
        {"choices": [{"message": {"content": "yes"}}]},
        {"choices": [{"logprobs": None}]},
        {"choices": [{"logprobs": {"content": []}}]},
        _chat([{"token": 5, "logprob": -1}]),
        _chat([{"token": "yes", "logprob": "high"}]),
        _chat([{"token": "yes", "logprob": True}]),
        _chat([{"token": "yes", "logprob": None}]),  # how a NaN or -inf is sent as JSON
        _chat([{"token": "yes"}]),
        _chat("yes"),
        "not a dict",
    ],
)
def test_malformed_shapes_raise(body: object) -> None:
    with pytest.raises(MalformedLogprobs, match="no top_logprobs"):
        _top(body)


# The last: nesting deeper than the decoder goes, in a field it skips.
@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"<html>busy</html>",
        b'{"choices": [',
        b"\xff",
        b'{"x": ' + b"[" * 5000 + b"]" * 5000 + b', "choices": []}',
    ],
)
def test_an_answer_that_is_not_json_is_a_decoding_error(raw: bytes) -> None:
    """Not MalformedLogprobs (JSON of the wrong shape): the HTTP client counts bytes that
    are not JSON as a failed call (`HttpBackend._send_single_request`), deep nesting
    included."""
    with pytest.raises((msgspec.DecodeError, RecursionError)):
        decode_chat(raw)
