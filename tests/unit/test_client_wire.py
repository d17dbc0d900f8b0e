"""The Python client's wire conversion: every field a caller gives reaches the request,
unset ones stay unset, and answers come back whole."""

from __future__ import annotations

import dataclasses

import pytest
from rerank_client import Candidate, RankedList
from rerank_client.pb import rerank_pb2 as pb
from rerank_client.types import RerankAnswer, Result, build_request


def test_request_carries_every_given_field_and_leaves_the_rest_unset() -> None:
    request = build_request(
        "q",
        [
            "plain text",
            {"id": 7, "text": "from a mapping", "retrieval_score": 3.5},
            Candidate(
                id="c",
                text="full",
                title="T",
                retrieval_score=0.0,
                retrieval_rank=4,
                metadata={"lang": "en"},
            ),
        ],
        lists=[
            RankedList(
                "dense",
                ["d0", {"text": "d1", "retrieval_rank": 1}],
                weight=1.5,
                expansion=True,
                score_kind="similarity",
            )
        ],
    )
    plain, mapped, full = request.candidates
    assert (plain.id, plain.text) == ("0", "plain text")
    for name in ("title", "retrieval_score", "retrieval_rank"):
        assert not plain.HasField(name), name
    assert not plain.metadata
    assert (mapped.id, mapped.retrieval_score) == ("7", 3.5)
    assert not mapped.HasField("retrieval_rank")
    assert full.title == "T" and full.HasField("retrieval_score")
    assert full.retrieval_score == 0.0  # zero is a given score, not an unset one
    assert full.retrieval_rank == 4 and dict(full.metadata) == {"lang": "en"}
    (dense,) = request.lists
    assert (dense.name, dense.weight, dense.expansion) == ("dense", 1.5, True)
    assert dense.score_kind == pb.SCORE_KIND_SIMILARITY
    assert [(c.id, c.text) for c in dense.candidates] == [("0", "d0"), ("1", "d1")]
    assert dense.candidates[1].retrieval_rank == 1


def test_answer_reads_every_result_field() -> None:
    response = pb.RerankResponse(
        request_id="r",
        results=[
            pb.RankedResult(
                id="a",
                index=2,
                rank=1,
                score=0.9,
                reranker_score=0.0,
                retrieval_score=5.0,
                retrieval_rank=3,
                scored_text="chunk",
                metadata={"k": "v"},
                normalized_retrieval_score=0.5,
                found_in=["bm25"],
                cached=True,
            ),
            pb.RankedResult(id="b", index=0, rank=2, score=0.1, retrieval_rank=1),
        ],
    )
    full, bare = RerankAnswer.from_pb(response).results
    # Every field by name: `Result.from_pb` passes them by position.
    assert (full.id, full.index, full.rank, full.score, full.retrieval_rank) == ("a", 2, 1, 0.9, 3)
    assert (full.reranker_score, full.retrieval_score, full.scored_text) == (0.0, 5.0, "chunk")
    assert full.metadata == {"k": "v"} and full.found_in == ("bm25",) and full.cached
    assert full.normalized_retrieval_score == 0.5
    assert bare.reranker_score is None and bare.retrieval_score is None
    assert bare.scored_text is None and bare.normalized_retrieval_score is None
    assert bare.metadata == {} and bare.found_in == () and not bare.cached
    # Built by writing the slots directly, yet the same as the dataclass's own: equal,
    # hashable where its fields are, and frozen.
    assert bare == Result("b", 0, 2, 0.1, None, None, 1, None, {}, None, (), False)
    assert repr(full).startswith("Result(id='a', index=2")
    with pytest.raises(dataclasses.FrozenInstanceError):
        full.score = 1.0  # type: ignore[misc]


def test_a_result_subclass_is_built_as_itself() -> None:
    class Mine(Result):
        __slots__ = ()

    built = Mine.from_pb(pb.RankedResult(id="a", index=0, rank=1, score=0.5, retrieval_rank=1))
    assert type(built) is Mine and built.id == "a"


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2**40}, "top_k"),
        ({"timeout_ms": -5}, "timeout_ms"),
        ({"max_candidates": 2**32}, "max_candidates"),
    ],
)
def test_a_number_out_of_range_is_named(options: dict[str, int], named: str) -> None:
    """protobuf's own error said only "Value out of range: -1"."""
    with pytest.raises(ValueError, match=f"^{named} must be a whole number from 0 to"):
        build_request("q", ["a"], **options)  # type: ignore[arg-type]


def test_a_candidate_of_another_type_is_named() -> None:
    """A bare `TypeError: 'int' object is not iterable` came from inside the client."""
    with pytest.raises(TypeError, match=r"^candidates\[1\]: expected a str, a Candidate"):
        build_request("q", ["a", 5])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"^candidates\[0\]: .*unexpected keyword"):
        build_request("q", [{"text": "a", "body": "b"}])
    with pytest.raises(TypeError, match=r"^lists\['bm25'\].candidates\[0\]: expected"):
        build_request("q", lists=[RankedList("bm25", [None])])  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("candidate", "error", "message"),
    [
        (
            {"text": "x", "retrieval_rank": -1},
            ValueError,
            r"candidates\[1\]\.retrieval_rank must be a whole number from 0 to 4294967295, not -1",
        ),
        ({"text": 5}, TypeError, r"candidates\[1\]\.text: expected a str, not int"),
        ({"text": "x", "title": 3}, TypeError, r"candidates\[1\]\.title: expected a str, not int"),
        (
            {"text": "x", "retrieval_score": "0.5"},
            TypeError,
            r"candidates\[1\]\.retrieval_score: expected a number, not str",
        ),
        (
            {"text": "x", "metadata": {"a": 1}},
            TypeError,
            r"candidates\[1\]\.metadata: expected a mapping of str to str, not a mapping with "
            r"int values",
        ),
        ({"text": "\ud800"}, ValueError, r"candidates\[1\]\.text: not valid Unicode \(.*\)"),
    ],
)
def test_a_candidates_bad_field_is_named(
    candidate: dict[str, object], error: type, message: str
) -> None:
    """protobuf said "Value out of range: -1" or "bad argument type for built-in
    operation", naming neither the candidate nor the field (`rerank-client --file`
    printed just that for a bad line)."""
    with pytest.raises(error, match=f"^{message}$"):
        build_request("q", ["a", candidate])  # type: ignore[list-item]


def test_codes_this_client_does_not_know_are_read_not_raised() -> None:
    """The proto only ever adds values: a newer server's degraded code or blend strategy
    failed the whole answer with a ValueError (not a RerankError) in this client."""
    response = pb.RerankResponse(
        request_id="r",
        blend_strategy=99,  # type: ignore[arg-type]
        degraded=pb.DegradedReason(code=99, message="new"),
    )  # type: ignore[arg-type]
    summary = RerankAnswer.from_pb(response).summary
    assert summary.degraded_code == "unknown_99" and summary.degraded_message == "new"
    assert summary.blend_strategy == "unknown_99"
    known = pb.RerankResponse(
        degraded=pb.DegradedReason(code=pb.DEGRADED_REASON_CODE_TOO_FEW_CANDIDATES)
    )
    assert RerankAnswer.from_pb(known).summary.degraded_code == "too_few_candidates"
