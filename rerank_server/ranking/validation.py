"""Request validation and resolution: a `RerankQuery` checked and turned into a `Request`.

Errors name the field as a caller writes it and the limit, never quoting text.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from ..domain import Candidate, RerankQuery, ThresholdMode, ThresholdSpec
from ..errors import InvalidRequest
from .request import Request, RequestRules, SkipRules
from .shaping import ADAPTIVE_DEFAULTS, IMPLICIT_LIST

MAX_TIMEOUT_MS = 600_000
MAX_FUSION_K = 10_000
MIN_CHUNK_CHARS = 100
MIN_TOKENS_PER_DOC = 16
MAX_TOKENS_PER_DOC = 1_000_000
MAX_LIST_WEIGHT = 1e6
MIN_THRESHOLD_STEP = 0.001  # at most 1,000 steps from start to floor


def _check_length(field: str, value: str, limit: int) -> None:
    if len(value) > limit:
        raise InvalidRequest(field, f"{len(value)} characters exceeds the limit of {limit}")


def resolve(query: RerankQuery, rules: RequestRules) -> Request:
    """`query` with every option resolved; raises InvalidRequest for the first rule broken."""
    validate(query, rules)
    r = rules
    lists = tuple(
        dataclasses.replace(lst, weight=_list_weight(lst.weight, lst.expansion, r))
        for lst in query.lists
    )
    return Request(
        request_id=query.request_id,
        query=query.query,
        candidates=query.candidates,
        lists=lists,
        candidates_weight=r.original_list_weight,
        top_k=query.top_k,
        instruction=r.instruction if query.instruction is None else query.instruction,
        blend=query.blend or r.blend,
        # A request may ask for less than the operator allows, never for more.
        max_candidates=min(query.max_candidates or r.max_candidates, r.max_candidates),
        timeout_s=min(query.timeout_s or r.timeout_s, r.timeout_s),
        max_chunk_chars=query.max_chunk_chars or r.max_chunk_chars,
        max_tokens_per_doc=query.max_tokens_per_doc or r.max_tokens_per_doc,
        return_text=query.return_text,
        score_kind=query.score_kind,
        fusion_k=query.fusion_k or r.fusion_k,
        dedup_key=query.dedup_key,
        threshold=query.threshold,
        skip=SkipRules(
            disabled=r.disabled,
            min_candidates=r.min_candidates,
            within_top_k=_or_default(query.skip_within_top_k, r.skip_within_top_k),
            strong_signal=_or_default(query.strong_signal_skip, r.strong_signal_skip),
            strong_signal_min=r.strong_signal_min,
            strong_signal_gap=r.strong_signal_gap,
        ),
        bypass_cache=query.bypass_cache,
        always_score=query.always_score,
    )


def _list_weight(weight: float | None, expansion: bool, rules: RequestRules) -> float:
    if weight is not None:
        return weight
    return rules.expansion_list_weight if expansion else rules.original_list_weight


def _or_default(value: bool | None, default: bool) -> bool:
    return default if value is None else value


def validate(query: RerankQuery, rules: RequestRules) -> None:
    """Raise InvalidRequest for the first rule `query` breaks."""
    _check_length("request_id", query.request_id, rules.max_id_chars)
    if not query.query.strip():
        raise InvalidRequest("query", "must not be empty")
    _check_length("query", query.query, rules.max_query_chars)
    if query.instruction is not None:
        if not query.instruction.strip():
            raise InvalidRequest("instruction", "must not be blank when set")
        _check_length("instruction", query.instruction, rules.max_query_chars)
    metadata = _MetadataBudget(rules)
    _validate_candidates("candidates", query.candidates, rules, metadata)
    _validate_lists(query, rules, metadata)
    _validate_options(query, rules)


class _MetadataBudget:
    """Checks each candidate's metadata and counts it against the request-wide limit."""

    def __init__(self, rules: RequestRules) -> None:
        self._rules = rules
        self._left = rules.max_metadata_request_chars

    def check(self, at: str, metadata: Mapping[str, str]) -> None:
        r = self._rules
        if len(metadata) > r.max_metadata_entries:
            raise InvalidRequest(
                f"{at}.metadata",
                f"{len(metadata)} entries exceeds the limit of {r.max_metadata_entries}",
            )
        for key, value in metadata.items():
            if len(key) > r.max_metadata_key_chars:
                raise InvalidRequest(
                    f"{at}.metadata",
                    f"a key of {len(key)} characters "
                    f"exceeds the limit of {r.max_metadata_key_chars}",
                )
            if len(value) > r.max_metadata_value_chars:
                # The key is the caller's field name, not document text: safe to name.
                _check_length(f"{at}.metadata[{key[:64]!r}]", value, r.max_metadata_value_chars)
            self._left -= len(key) + len(value)
        if self._left < 0:
            raise InvalidRequest(
                f"{at}.metadata",
                "the request's metadata exceeds the "
                f"limit of {r.max_metadata_request_chars} characters in all",
            )


def check_candidate_count(where: str, count: int, rules: RequestRules) -> None:
    """The cap on candidates, which an edge may apply before building any (a JSON body
    of millions of empty documents is cheap to send and dear to convert)."""
    if count > rules.max_request_candidates:
        raise InvalidRequest(
            where, f"{count} candidates exceeds the limit of {rules.max_request_candidates}"
        )


def check_list_count(count: int, rules: RequestRules) -> None:
    """The cap on lists, which an edge may apply before building any (as candidates)."""
    if count > rules.max_lists:
        raise InvalidRequest("lists", f"{count} lists exceeds the limit of {rules.max_lists}")


def _validate_candidates(
    where: str, candidates: Sequence[Candidate], rules: RequestRules, metadata: _MetadataBudget
) -> None:
    check_candidate_count(where, len(candidates), rules)
    max_id, max_text = rules.max_id_chars, rules.max_document_chars
    seen: dict[str, int] = {}
    # Every candidate of every request passes here: the checks are inline and a field's
    # name is only spelled out for the one that fails.
    for i, c in enumerate(candidates):
        if not c.id or len(c.id) > max_id or c.id in seen:
            _bad_id(f"{where}[{i}]", c.id, max_id, where, seen)
        seen[c.id] = i
        if len(c.text) > max_text:
            _check_length(f"{where}[{i}].text", c.text, max_text)
        if c.title is not None and len(c.title) > max_text:
            _check_length(f"{where}[{i}].title", c.title, max_text)
        if c.retrieval_rank < 1:
            raise InvalidRequest(f"{where}[{i}].retrieval_rank", "must be at least 1 when set")
        if c.retrieval_score is not None and not math.isfinite(c.retrieval_score):
            raise InvalidRequest(f"{where}[{i}].retrieval_score", "must be a finite number")
        if c.metadata:
            metadata.check(f"{where}[{i}]", c.metadata)


def _bad_id(at: str, id_: str, limit: int, where: str, seen: Mapping[str, int]) -> None:
    if not id_:
        raise InvalidRequest(f"{at}.id", "must not be empty")
    _check_length(f"{at}.id", id_, limit)
    raise InvalidRequest(f"{at}.id", f"duplicate of {where}[{seen[id_]}].id")


def _validate_lists(query: RerankQuery, rules: RequestRules, metadata: _MetadataBudget) -> None:
    check_list_count(len(query.lists), rules)
    # With lists, the request's own `candidates` form one more list with this name.
    names = {IMPLICIT_LIST: "candidates"} if query.candidates else {}
    for i, lst in enumerate(query.lists):
        where = f"lists[{i}]"
        _check_length(f"{where}.name", lst.name, rules.max_id_chars)
        if lst.name in names:
            raise InvalidRequest(f"{where}.name", f"same name as {names[lst.name]}")
        names[lst.name] = where
        if lst.weight is not None and not 0 <= lst.weight <= MAX_LIST_WEIGHT:  # NaN too
            # Weights are relative; near the float limit their fused sum overflowed to
            # infinity and every normalized score came out NaN.
            raise InvalidRequest(
                f"{where}.weight", f"must be a number from 0 to {MAX_LIST_WEIGHT:g}"
            )
        _validate_candidates(f"{where}.candidates", lst.candidates, rules, metadata)


def _validate_options(query: RerankQuery, rules: RequestRules) -> None:
    if query.max_candidates is not None and not (
        1 <= query.max_candidates <= rules.max_request_candidates
    ):
        raise InvalidRequest(
            "options.max_candidates", f"must be between 1 and {rules.max_request_candidates}"
        )
    if query.timeout_s is not None and not (0 < query.timeout_s * 1000 <= MAX_TIMEOUT_MS):
        raise InvalidRequest("options.timeout_ms", f"must be between 1 and {MAX_TIMEOUT_MS}")
    if query.max_chunk_chars is not None and not (
        MIN_CHUNK_CHARS <= query.max_chunk_chars <= rules.max_document_chars
    ):
        raise InvalidRequest(
            "options.max_chunk_chars",
            f"must be between {MIN_CHUNK_CHARS} and {rules.max_document_chars}",
        )
    if query.max_tokens_per_doc is not None and not (
        MIN_TOKENS_PER_DOC <= query.max_tokens_per_doc <= MAX_TOKENS_PER_DOC
    ):
        raise InvalidRequest(
            "options.max_tokens_per_doc",
            f"must be between {MIN_TOKENS_PER_DOC} and {MAX_TOKENS_PER_DOC}",
        )
    if query.fusion_k is not None and not 1 <= query.fusion_k <= MAX_FUSION_K:
        raise InvalidRequest("options.fusion_k", f"must be between 1 and {MAX_FUSION_K}")
    _check_length("options.dedup_key", query.dedup_key, rules.max_id_chars)
    if query.threshold is not None:
        _validate_threshold(query, query.threshold)


def _validate_threshold(query: RerankQuery, t: ThresholdSpec) -> None:
    for name in ("min_score", "start", "step", "floor", "target_fraction"):
        value = getattr(t, name)
        if value is not None and not (math.isfinite(value) and 0 <= value <= 1):
            raise InvalidRequest(f"options.threshold.{name}", "must be between 0 and 1")
    if t.step is not None and t.step < MIN_THRESHOLD_STEP:
        # Each step is a pass over the candidates, and a step below 5e-10 does not move
        # the threshold (rounded to 9 places): the request would spin the loop for good.
        raise InvalidRequest("options.threshold.step", f"must be at least {MIN_THRESHOLD_STEP}")
    if t.target_fraction is not None and t.target_fraction <= 0:
        raise InvalidRequest("options.threshold.target_fraction", "must be greater than 0")
    start = ADAPTIVE_DEFAULTS["start"] if t.start is None else t.start
    floor = ADAPTIVE_DEFAULTS["floor"] if t.floor is None else t.floor
    if t.mode is ThresholdMode.ADAPTIVE and floor > start:
        raise InvalidRequest("options.threshold.floor", "must not be above start")
    if not query.lists and any(c.retrieval_score is None for c in query.candidates):
        raise InvalidRequest(
            "options.threshold",
            "filters on retrieval scores: every "
            "candidate needs retrieval_score (or send lists to fuse)",
        )
