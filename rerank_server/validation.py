"""Request validation against the configured limits.

Every violation raises `InvalidRequest` naming the field as a caller would write it
(`candidates[3].text`) and the limit, never quoting the offending text. An empty candidate
list is valid: it gets an empty answer.
"""

from __future__ import annotations

import math

from .domain import RerankQuery
from .errors import InvalidRequest
from .settings import Settings

MAX_TIMEOUT_MS = 600_000
MIN_CHUNK_CHARS = 100


def _check_length(field: str, value: str, limit: int) -> None:
    if len(value) > limit:
        raise InvalidRequest(field, f"{len(value)} characters exceeds the limit of {limit}")


def validate(query: RerankQuery, settings: Settings) -> None:
    """Raise InvalidRequest for the first rule `query` breaks."""
    _check_length("request_id", query.request_id, settings.max_id_chars)
    if not query.query.strip():
        raise InvalidRequest("query", "must not be empty")
    _check_length("query", query.query, settings.max_query_chars)
    if query.instruction is not None:
        if not query.instruction.strip():
            raise InvalidRequest("instruction", "must not be blank when set")
        _check_length("instruction", query.instruction, settings.max_query_chars)
    if len(query.candidates) > settings.max_request_candidates:
        raise InvalidRequest("candidates", f"{len(query.candidates)} candidates exceeds the "
                                           f"limit of {settings.max_request_candidates}")
    _validate_options(query, settings)
    seen: dict[str, int] = {}
    for i, c in enumerate(query.candidates):
        where = f"candidates[{i}]"
        if not c.id:
            raise InvalidRequest(f"{where}.id", "must not be empty")
        _check_length(f"{where}.id", c.id, settings.max_id_chars)
        if c.id in seen:
            raise InvalidRequest(f"{where}.id", f"duplicate of candidates[{seen[c.id]}].id")
        seen[c.id] = i
        _check_length(f"{where}.text", c.text, settings.max_document_chars)
        if c.title is not None:
            _check_length(f"{where}.title", c.title, settings.max_document_chars)
        if c.retrieval_rank < 1:
            raise InvalidRequest(f"{where}.retrieval_rank", "must be at least 1 when set")
        if c.retrieval_score is not None and not math.isfinite(c.retrieval_score):
            raise InvalidRequest(f"{where}.retrieval_score", "must be a finite number")


def _validate_options(query: RerankQuery, settings: Settings) -> None:
    if query.max_candidates is not None and not (
            1 <= query.max_candidates <= settings.max_request_candidates):
        raise InvalidRequest("options.max_candidates", "must be between 1 and "
                                                       f"{settings.max_request_candidates}")
    if query.timeout_s is not None and not (0 < query.timeout_s * 1000 <= MAX_TIMEOUT_MS):
        raise InvalidRequest("options.timeout_ms", f"must be between 1 and {MAX_TIMEOUT_MS}")
    if query.max_chunk_chars is not None and not (
            MIN_CHUNK_CHARS <= query.max_chunk_chars <= settings.max_document_chars):
        raise InvalidRequest("options.max_chunk_chars", f"must be between {MIN_CHUNK_CHARS} "
                                                        f"and {settings.max_document_chars}")
