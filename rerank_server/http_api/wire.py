"""A rerank body's JSON, parsed once and checked for shape on the way.

Why msgspec, and what each layer checks: docs/http.md, "Errors".
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any

import msgspec

from ..errors import InvalidRequest
from ..ranking.request import RequestRules
from ..ranking.validation import check_candidate_count

# Scalars are left loose, so that pydantic still reports a wrong type in its own words;
# containers are what this layer bounds.
Scalar = str | int | float | bool | None
_UNSET = msgspec.UNSET
# Fields of one document object: `text`, `title`, our extras and what `rank_fields` or
# `return_documents` use; far more than any such document has.
MAX_DOCUMENT_FIELDS = 256
_Fields = Annotated[dict[str, Scalar], msgspec.Meta(max_length=MAX_DOCUMENT_FIELDS)]


class _Cohere(msgspec.Struct, omit_defaults=True):
    query: Scalar | msgspec.UnsetType = _UNSET
    documents: list[Scalar | _Fields] | msgspec.UnsetType = _UNSET
    model: Scalar | msgspec.UnsetType = _UNSET
    top_n: Scalar | msgspec.UnsetType = _UNSET
    return_documents: Scalar | msgspec.UnsetType = _UNSET
    rank_fields: list[Scalar] | msgspec.UnsetType | None = _UNSET
    max_tokens_per_doc: Scalar | msgspec.UnsetType = _UNSET
    max_chunks_per_doc: Scalar | msgspec.UnsetType = _UNSET
    instruction: Scalar | msgspec.UnsetType = _UNSET
    blend_strategy: Scalar | msgspec.UnsetType = _UNSET
    request_id: Scalar | msgspec.UnsetType = _UNSET
    max_candidates: Scalar | msgspec.UnsetType = _UNSET
    timeout_ms: Scalar | msgspec.UnsetType = _UNSET
    always_score: Scalar | msgspec.UnsetType = _UNSET


class _Root(_Cohere, omit_defaults=True):
    """`/rerank`: TEI's fields beside Cohere's (Infinity and vLLM clients post there)."""

    texts: list[Scalar] | msgspec.UnsetType = _UNSET
    raw_scores: Scalar | msgspec.UnsetType = _UNSET
    return_text: Scalar | msgspec.UnsetType = _UNSET
    truncate: Scalar | msgspec.UnsetType = _UNSET
    truncation_direction: Scalar | msgspec.UnsetType = _UNSET


class _CohereOnly(_Cohere, forbid_unknown_fields=True):
    pass


class _RootOnly(_Root, forbid_unknown_fields=True):
    pass


_Decoders = dict[str, msgspec.json.Decoder[Any]]
_DECODERS: _Decoders = {
    "/v1/rerank": msgspec.json.Decoder(_Cohere),
    "/v2/rerank": msgspec.json.Decoder(_Cohere),
    "/rerank": msgspec.json.Decoder(_Root),
}
# The same shapes with nothing else beside them (see `_with_surrogates`).
_WHOLE: _Decoders = {
    "/v1/rerank": msgspec.json.Decoder(_CohereOnly),
    "/v2/rerank": msgspec.json.Decoder(_CohereOnly),
    "/rerank": msgspec.json.Decoder(_RootOnly),
}
# A UTF-16 surrogate escape; in a copy only ever checked for shape, so an escaped
# backslash before one (literal text) changing too does no harm.
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_AT = re.compile(r" - at `\$(.*)`$")
_MALFORMED = re.compile(r"^JSON is malformed: (.*) \(byte (\d+)\)$")


class ShapeError(ValueError):
    """The body cannot be this route's request: `str(exc)` is `field: problem`."""


def decoded(path: str, body: bytes, rules: RequestRules) -> dict[str, Any]:
    """`body` as `path`'s request: its known fields, as the standard library's parser
    would give them. ShapeError when it is not JSON, holds a container where the request
    has a scalar, a document object of more than `MAX_DOCUMENT_FIELDS` fields, or more
    documents than `rules` allow (counted before pydantic builds any)."""
    try:
        request = _DECODERS[path].decode(body)
    except msgspec.ValidationError as exc:
        raise ShapeError(_validation(str(exc))) from None
    except msgspec.DecodeError as exc:
        # (msgspec's message for a lone surrogate varies: "truncated", "invalid pair")
        whole = _with_surrogates(path, body) if _SURROGATE.search(body) else None
        if whole is None:
            raise ShapeError(_malformed(str(exc))) from None
        _count(whole, rules)
        # The shape holds, nothing else is beside it: the standard library reads the
        # surrogates msgspec cannot hold, and the app names the field that has one.
        parsed: dict[str, Any] = json.loads(body)
        return parsed
    except UnicodeDecodeError:
        raise ShapeError(f"body: not valid UTF-8 at byte {_bad_utf8_at(body)}") from None
    except RecursionError:  # skipping an unknown field nested a thousand deep
        raise ShapeError("body: nested too deeply") from None
    _count(request, rules)
    return {
        name: value
        for name in request.__struct_fields__
        if (value := getattr(request, name)) is not _UNSET
    }


def _count(request: _Cohere, rules: RequestRules) -> None:
    """The candidate cap (`check_candidate_count`), before any document is built
    (validation applies it again to the request it builds, as for gRPC)."""
    for field in ("texts", "documents"):
        documents = getattr(request, field, _UNSET)
        if documents is not _UNSET:
            try:
                check_candidate_count(field, len(documents), rules)
            except InvalidRequest as exc:
                raise ShapeError(str(exc)) from None


def _bad_utf8_at(body: bytes) -> int | str:
    """Where in `body` the UTF-8 breaks: msgspec's error counts from the start of the
    string that holds it, not of the body."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc.start
    return "?"


def _with_surrogates(path: str, body: bytes) -> _Cohere | None:
    """`body`, which msgspec refused for a lone surrogate escape, decoded with the
    surrogates blanked when it may go on as it is (None when not): it has that request's
    shape and nothing beside (no unknown field whose contents would be built unchecked)."""
    try:
        whole: _Cohere = _WHOLE[path].decode(_SURROGATE.sub(rb"\\u0020", body))
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return None
    return whole


# msgspec names the types of the shapes above; what a caller may send, in words. (A
# number where text is due passes here, and is refused by the field's own type later.)
_EXPECTED = {
    "`bool | int | float | str | object | null`": "a string, or an object with text",
    "`bool | int | float | str | null`": "a single value, not a list or an object",
}


def _validation(message: str) -> str:
    """msgspec's `Expected X, got Y - at $.documents[0].x` as `documents[0].x: ...`."""
    at = _AT.search(message)
    field = (at.group(1).lstrip(".") or "body") if at else "body"
    problem = _AT.sub("", message)
    for expected, words in _EXPECTED.items():
        problem = problem.replace(expected, words)
    problem = problem[:1].lower() + problem[1:]
    if field.endswith("[...]"):  # a value in a document object; msgspec keeps no key
        field, problem = field.removesuffix("[...]"), f"a field's value: {problem}"
    return f"{field}: {problem}"


def _malformed(message: str) -> str:
    found = _MALFORMED.match(message)
    if found:
        return f"body: not valid JSON at byte {found.group(2)} ({found.group(1)})"
    return f"body: not valid JSON ({message})"
