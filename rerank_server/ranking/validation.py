"""Request validation against the configured limits.

Every violation raises `InvalidRequest` naming the field as a caller would write it
(`candidates[3].text`) and the limit, never quoting the offending text. An empty candidate
list is valid: it gets an empty answer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..domain import Candidate, RerankQuery, ThresholdMode, ThresholdSpec
from ..errors import InvalidRequest
from ..settings import Settings
from .shaping import ADAPTIVE_DEFAULTS, IMPLICIT_LIST

MAX_TIMEOUT_MS = 600_000
MAX_FUSION_K = 10_000
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
    _validate_candidates("candidates", query.candidates, settings)
    _validate_lists(query, settings)
    _validate_options(query, settings)


def _validate_candidates(where: str, candidates: Sequence[Candidate],
                         settings: Settings) -> None:
    if len(candidates) > settings.max_request_candidates:
        raise InvalidRequest(where, f"{len(candidates)} candidates exceeds the "
                                    f"limit of {settings.max_request_candidates}")
    seen: dict[str, int] = {}
    for i, c in enumerate(candidates):
        at = f"{where}[{i}]"
        if not c.id:
            raise InvalidRequest(f"{at}.id", "must not be empty")
        _check_length(f"{at}.id", c.id, settings.max_id_chars)
        if c.id in seen:
            raise InvalidRequest(f"{at}.id", f"duplicate of {where}[{seen[c.id]}].id")
        seen[c.id] = i
        _check_length(f"{at}.text", c.text, settings.max_document_chars)
        if c.title is not None:
            _check_length(f"{at}.title", c.title, settings.max_document_chars)
        if c.retrieval_rank < 1:
            raise InvalidRequest(f"{at}.retrieval_rank", "must be at least 1 when set")
        if c.retrieval_score is not None and not math.isfinite(c.retrieval_score):
            raise InvalidRequest(f"{at}.retrieval_score", "must be a finite number")


def _validate_lists(query: RerankQuery, settings: Settings) -> None:
    if len(query.lists) > settings.max_lists:
        raise InvalidRequest("lists", f"{len(query.lists)} lists exceeds the limit of "
                                      f"{settings.max_lists}")
    # With lists, the request's own `candidates` form one more list with this name.
    names = {IMPLICIT_LIST: "candidates"} if query.candidates else {}
    for i, lst in enumerate(query.lists):
        where = f"lists[{i}]"
        _check_length(f"{where}.name", lst.name, settings.max_id_chars)
        if lst.name in names:
            raise InvalidRequest(f"{where}.name", f"same name as {names[lst.name]}")
        names[lst.name] = where
        if lst.weight is not None and not (math.isfinite(lst.weight) and lst.weight >= 0):
            raise InvalidRequest(f"{where}.weight", "must be a finite number >= 0")
        _validate_candidates(f"{where}.candidates", lst.candidates, settings)


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
    if query.fusion_k is not None and not 1 <= query.fusion_k <= MAX_FUSION_K:
        raise InvalidRequest("options.fusion_k", f"must be between 1 and {MAX_FUSION_K}")
    _check_length("options.dedup_key", query.dedup_key, settings.max_id_chars)
    if query.threshold is not None:
        _validate_threshold(query, query.threshold)


def _validate_threshold(query: RerankQuery, t: ThresholdSpec) -> None:
    for name in ("min_score", "start", "step", "floor", "target_fraction"):
        value = getattr(t, name)
        if value is not None and not (math.isfinite(value) and 0 <= value <= 1):
            raise InvalidRequest(f"options.threshold.{name}", "must be between 0 and 1")
    if t.step is not None and t.step <= 0:
        raise InvalidRequest("options.threshold.step", "must be greater than 0")
    if t.target_fraction is not None and t.target_fraction <= 0:
        raise InvalidRequest("options.threshold.target_fraction", "must be greater than 0")
    start = ADAPTIVE_DEFAULTS["start"] if t.start is None else t.start
    floor = ADAPTIVE_DEFAULTS["floor"] if t.floor is None else t.floor
    if t.mode is ThresholdMode.ADAPTIVE and floor > start:
        raise InvalidRequest("options.threshold.floor", "must not be above start")
    if not query.lists and any(c.retrieval_score is None for c in query.candidates):
        raise InvalidRequest("options.threshold", "filters on retrieval scores: every "
                             "candidate needs retrieval_score (or send lists to fuse)")
