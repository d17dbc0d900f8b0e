"""`completion`'s answers, decoded typed (only the fields read): what is scored, what
fails one result (its pair), what is malformed as a whole, and what is not JSON at all."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import orjson
import pytest

from rerank_server.scoring.backends import ollama
from rerank_server.scoring.backends.completion import MAX_RENDERED_CHARS, _decode, _rendered, _score
from rerank_server.scoring.backends.logprobs import p_yes
from rerank_server.scoring.transport.errors import MalformedResponse

IDS = {1: "yes", 2: "no"}


def _result(top: Any) -> dict[str, Any]:
    return {
        "completion_probabilities": [
            {"id": 1, "token": "yes", "bytes": [121], "logprob": -0.1, "top_logprobs": top}
        ],
        "model": "/models/m.gguf",
    }


def test_an_array_and_a_single_result_decode_alike() -> None:
    top = [
        {"id": 1, "token": "yes", "bytes": [121, 101, 115], "logprob": -0.5},
        {"id": 2, "token": "no", "bytes": [110, 111], "logprob": -2},
    ]
    one = _decode(orjson.dumps(_result(top)))
    assert one == _decode(orjson.dumps([_result(top)]))
    assert _score(one[0], IDS) == p_yes([("yes", -0.5), ("no", -2.0)])
    assert one[0].model == "/models/m.gguf"


def test_entries_of_other_tokens_need_neither_id_nor_logprob() -> None:
    top = [
        {"token": "The"},
        {"id": None, "logprob": -1.0},
        {"id": 7, "logprob": None},
        {"id": 1, "logprob": -0.2},
    ]
    assert _score(_decode(orjson.dumps([_result(top)]))[0], IDS) == p_yes([("yes", -0.2)])


@pytest.mark.parametrize(
    "result",
    [
        {"completion_probabilities": None},
        {"completion_probabilities": []},
        _result([{"id": 1, "logprob": "-0.1"}]),  # a string, a bool: not numbers
        _result([{"id": 1, "logprob": True}]),
        _result([{"id": 2}]),  # an answer token without its logprob
        _result(None),
    ],
)
def test_a_result_without_a_usable_answer_scores_nothing_alone(result: Any) -> None:
    """Only its own pair fails: the other results of the answer are scored."""
    good = _result([{"id": 1, "logprob": -0.3}])
    decoded = _decode(orjson.dumps([good, result, good]))
    assert [_score(r, IDS) is None for r in decoded] == [False, True, False]


def test_a_logprob_of_400_digits_fails_its_result_only() -> None:
    """JSON allows it; `float()` of it raised OverflowError, which failed the slice."""
    good = orjson.dumps(_result([{"id": 1, "logprob": -0.3}]))
    huge = good.replace(
        b'"top_logprobs":[{"id":1,"logprob":-0.3}]',
        b'"top_logprobs":[{"id":1,"logprob":-1' + b"0" * 400 + b"}]",
    )
    assert huge != good
    decoded = _decode(b"[" + good + b"," + huge + b"]")
    assert [_score(r, IDS) is None for r in decoded] == [False, True]


@pytest.mark.parametrize(
    "answer",
    [
        {"error": "busy"},
        "yes",
        [{"model": "m"}],
        [_result([{"id": "1", "logprob": -0.1}])],  # ids: ints
        [{"completion_probabilities": 3}],
        [{"completion_probabilities": [{"top_logprobs": [7]}]}],
    ],
)
def test_json_of_the_wrong_shape_is_malformed_as_a_whole(answer: Any) -> None:
    with pytest.raises(MalformedResponse, match="wrong shape"):
        _decode(orjson.dumps(answer))


def test_a_vanishing_logprob_is_clamped_not_minus_infinity() -> None:
    score = _score(_decode(orjson.dumps([_result([{"id": 2, "logprob": -1e300}])]))[0], IDS)
    assert score is not None and math.isfinite(score)


@pytest.mark.parametrize("raw", [b"", b"<html>busy</html>", b"[{", b"\xff"])
def test_bytes_that_are_not_json_are_a_decoding_error_not_malformed(raw: bytes) -> None:
    """The HTTP client counts those as a failed call
    (`HttpBackend._send_single_request`)."""
    with pytest.raises(msgspec.DecodeError) as caught:
        _decode(raw)
    assert not isinstance(caught.value, msgspec.ValidationError)


def test_a_rendered_template_of_megabytes_is_no_template() -> None:
    """The rendering is kept per instruction (64 of them): one of 10 MB each was 640 MB."""
    assert _rendered({"prompt": "<|user|>x<|end|>"}) == "<|user|>x<|end|>"
    with pytest.raises(MalformedResponse, match="longer than"):
        _rendered({"prompt": "x" * (MAX_RENDERED_CHARS + 1)})


def test_ollama_reads_its_number_from_the_start_of_the_answer() -> None:
    """A model that wrote 50 MB before its number was searched to the end: 1.4 s of event
    loop. The number leads a short answer, so only the start is read."""
    assert ollama.relevance({"response": "Relevance: 7"}) == pytest.approx(0.7)
    with pytest.raises(MalformedResponse, match="no number"):
        ollama.relevance({"response": "x" * ollama.ANSWER_CHARS + "8"})
