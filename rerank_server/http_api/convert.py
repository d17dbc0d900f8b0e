"""The JSON edge's conversion: the Cohere/Jina and TEI bodies to one `RerankQuery`, the
core's errors named as the client wrote the fields, and answers to each shape.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from ..domain import BlendStrategy, Candidate, RankedCandidate, RerankQuery, RerankSummary
from ..errors import InvalidRequest
from . import models as m


def relevance(result: RankedCandidate) -> float:
    """What a JSON client reads as relevance: the final score the results are sorted by.
    Under `rerank_only` (the JSON default) that is the model's own score, and 0 for a
    document it did not score, placed after every scored one (`ranking.ordering`), so a
    threshold keeps exactly what the model scored at or above it; under a blend it is
    the blended score."""
    return result.score


def as_written(exc: InvalidRequest, documents: str) -> str:
    """The core's field name as an HTTP client wrote it: `documents[3].text`, TEI's
    `texts[3]` (plain strings: no `.text`), and the top-level options (`max_candidates`,
    not `options.max_candidates`)."""

    def rename(name: str) -> str:
        name = name.removeprefix("options.")
        if not name.startswith("candidates"):
            return name
        name = documents + name[len("candidates") :]
        return name.removesuffix(".text") if documents == "texts" else name

    problem = exc.problem.replace("candidates[", f"{documents}[")
    return f"{rename(exc.field)}: {problem}"


def _bad_unicode(value: object) -> bool:
    """Whether `value` is a string no UTF-8 encoder takes (it holds a lone surrogate)."""
    if not isinstance(value, str) or value.isascii():
        return False
    try:
        value.encode()
    except UnicodeEncodeError:
        return True
    return False


def check_echoed(documents: Sequence[str | m.Document]) -> None:
    """`return_documents` sends object documents back whole, fields the model does not
    read included: one holding a lone surrogate would fail the answer's encoding (a
    500), so it is refused, named, as the fields the model reads are."""
    for i, doc in enumerate(documents):
        if isinstance(doc, m.Document) and doc.model_extra:
            for key, value in doc.model_extra.items():
                if _bad_unicode(key) or _bad_unicode(value):
                    name = key[:64] if not _bad_unicode(key) else "(a field name)"
                    raise InvalidRequest(
                        f"candidates[{i}].{name}", "is not valid Unicode (a lone surrogate)"
                    )


def check_unicode(query: RerankQuery, documents: str) -> None:
    """JSON can carry lone surrogates ("\\ud800"), which no UTF-8 encoder takes: refuse them
    here, naming the field, rather than fail later (protobuf already guarantees UTF-8).
    The request id too: it is echoed in the answer, whose encoding would fail (a 500)."""

    def refuse(field: str) -> None:
        raise InvalidRequest(field, "is not valid Unicode (a lone surrogate)")

    for field, value in (
        ("query", query.query),
        ("instruction", query.instruction),
        ("request_id", query.request_id),
    ):
        if _bad_unicode(value):
            refuse(field)
    for c in query.candidates:  # a field's name is spelled out only for the one that fails
        for name, value in (("id", c.id), ("text", c.text), ("title", c.title)):
            if _bad_unicode(value):
                refuse(f"candidates[{c.index}].{name}")


def validation_message(errors: Sequence[Any]) -> str:
    """The first of pydantic's errors, as `field: problem`. A document is `str |
    Document`: for an object, the `Document` branch's error says what is wrong with it
    (the `str` branch's would only say it is not a string)."""
    if not errors:
        return "body: invalid"
    first = errors[0]
    loc = tuple(first.get("loc", ()))
    if loc[-1:] == ("str",) and isinstance(first.get("input"), dict):
        first = next((e for e in errors if "Document" in e.get("loc", ())), first)
        loc = tuple(first.get("loc", ()))
    return f"{_field(loc)}: {first['msg']}"


def _field(loc: Sequence[Any]) -> str:
    """A pydantic error location as the client wrote it: `documents[3].text`."""
    out = ""
    for part in loc:
        if part == "body":
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "Document", "tei", "cohere"):  # a union's member: not a field
            continue
        else:
            out += f".{part}" if out else str(part)
    return out or "body"


def _text(doc: str | m.Document, rank_fields: list[str] | None, i: int) -> str:
    """What the model reads of a document. An object with nothing to read (no `text`, or
    none of the `rank_fields`) is refused: it was scored as an empty text."""
    if isinstance(doc, str):
        return doc
    if rank_fields:
        values = {**(doc.model_extra or {}), **doc.model_dump(exclude_none=True)}
        if not any(f in values for f in rank_fields):
            raise InvalidRequest(
                f"documents[{i}]",
                f"has none of the rank_fields ({', '.join(repr(f[:64]) for f in rank_fields)})",
            )
        return "\n".join(f"{f}: {values[f]}" for f in rank_fields if f in values)
    if doc.text is None:
        raise InvalidRequest(
            f"documents[{i}].text",
            "missing: a document given as an "
            "object needs its text (or rank_fields naming its fields)",
        )
    return doc.text


def as_sent(doc: str | m.Document) -> dict[str, Any]:
    """`return_documents`: a document as the caller sent it (an object with all its
    fields, those sent as null too, not the `rank_fields` text the model read), as
    Cohere's API returns it."""
    if isinstance(doc, str):
        return {"text": doc}
    return doc.model_dump(exclude_unset=True)


def _default_ids(documents: Sequence[str | m.Document]) -> list[str]:
    """Each document's own id, or its index for one without; a default that another
    document gives as its id is refused, naming both (rather than reported as a
    duplicate of an id the caller never wrote)."""
    given = {d.id: i for i, d in enumerate(documents) if isinstance(d, m.Document) and d.id}
    ids: list[str] = []
    for i, doc in enumerate(documents):
        own = doc.id if isinstance(doc, m.Document) else None
        if not own and given and str(i) in given:
            raise InvalidRequest(
                f"candidates[{i}].id",
                f"not given, so its index {str(i)!r}, which "
                f"documents[{given[str(i)]}] gives as its id: give every document an id, "
                "or none",
            )
        ids.append(own or str(i))
    return ids


def _blend(name: str | None, default: BlendStrategy) -> BlendStrategy:
    return BlendStrategy(name) if name else default


def cohere_query(body: m.CohereRerankRequest, default_blend: BlendStrategy) -> RerankQuery:
    candidates = []
    ids = _default_ids(body.documents)
    for i, doc in enumerate(body.documents):
        obj = doc if isinstance(doc, m.Document) else None
        candidates.append(
            Candidate(
                id=ids[i],
                text=_text(doc, body.rank_fields, i),
                index=i,
                retrieval_rank=(
                    obj.retrieval_rank if obj is not None and obj.retrieval_rank else i + 1
                ),
                title=obj.title if obj is not None else None,
                retrieval_score=obj.retrieval_score if obj is not None else None,
            )
        )
    return RerankQuery(
        request_id=body.request_id or os.urandom(16).hex(),
        query=body.query,
        candidates=tuple(candidates),
        top_k=body.top_n or 0,
        instruction=body.instruction,
        blend=_blend(body.blend_strategy, default_blend),
        max_candidates=body.max_candidates,
        timeout_s=body.timeout_ms / 1000 if body.timeout_ms else None,
        max_tokens_per_doc=body.max_tokens_per_doc,
        # Every document gets the model's judgement (`reranker_score`), whatever the blend.
        always_score=True,
    )


def tei_query(body: m.TeiRerankRequest, default_blend: BlendStrategy) -> RerankQuery:
    return RerankQuery(
        request_id=os.urandom(16).hex(),
        query=body.query,
        candidates=tuple(
            Candidate(id=str(i), text=t, index=i, retrieval_rank=i + 1)
            for i, t in enumerate(body.texts)
        ),
        blend=default_blend,
        always_score=True,
    )


def cohere_answer(
    results: Sequence[RankedCandidate],
    summary: RerankSummary,
    version: str,
    model: str,
    documents: Sequence[str | m.Document] | None,
) -> m.CohereRerankResponse:
    """The Cohere-shaped answer; `documents`: the request's, to echo (`return_documents`)."""
    return m.CohereRerankResponse(
        id=summary.request_id,
        results=[
            m.CohereResult(
                index=r.candidate.index,
                relevance_score=relevance(r),
                document=as_sent(documents[r.candidate.index]) if documents is not None else None,
                id=r.candidate.id,
                reranker_score=r.reranker_score,
                retrieval_rank=r.candidate.retrieval_rank,
            )
            for r in results
        ],
        meta=answer_meta(summary, version, model),
    )


def tei_results(results: Sequence[RankedCandidate], return_text: bool) -> list[m.TeiResult]:
    return [
        m.TeiResult(
            index=r.candidate.index,
            score=relevance(r),
            text=r.candidate.text if return_text else None,
        )
        for r in results
    ]


def degraded_header(s: RerankSummary) -> str | None:
    """`X-Rerank-Degraded`: every reason's code, the main one first ("partial, capped")."""
    return ", ".join(d.code.value for d in s.degraded_reasons) or None


def answer_meta(s: RerankSummary, version: str, model: str) -> m.Meta:
    return m.Meta(
        api_version=m.ApiVersion(version=version),
        billed_units=m.BilledUnits(search_units=1),
        reranked=s.reranked,
        degraded=m.Degraded(code=s.degraded.code.value, message=s.degraded.message)
        if s.degraded
        else None,
        degraded_reasons=[
            m.Degraded(code=d.code.value, message=d.message) for d in s.degraded_reasons
        ]
        or None,
        backend=s.backend,
        model=model,
        blend_strategy=s.blend.value,
        blend_profile=s.blend_profile or None,
        scored=s.scored,
        failed=s.failed,
    )
