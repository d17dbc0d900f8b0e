"""Candidate shaping: normalize, deduplicate, fuse ranked lists, apply a threshold.

The rules: docs/api.md, "Several ranked lists", "Thresholds", "Skip rules".
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter

from ..domain import (
    Candidate,
    Degraded,
    DegradedCode,
    RankedList,
    ScoreKind,
    ThresholdMode,
    ThresholdReport,
    ThresholdSpec,
)
from .request import Request

_BY_RANK = attrgetter("retrieval_rank", "index")  # retrieval order, ties by position

IMPLICIT_LIST = "candidates"
FIXED_DEFAULT = 0.5
ADAPTIVE_DEFAULTS = {"start": 0.75, "step": 0.05, "floor": 0.35, "target_fraction": 0.8}
_EPS = 1e-9


@dataclass(frozen=True, slots=True)
class Shaped:
    """The candidates in retrieval order, and what shaping did to get there."""

    candidates: tuple[Candidate, ...]
    deduplicated: int = 0
    filtered: int = 0
    threshold: ThresholdReport | None = None
    # Top two normalized scores of the first lexical list, for the strong-signal rule.
    lexical_top: tuple[float, float] | None = None


@dataclass(frozen=True, slots=True)
class _Source:
    name: str
    weight: float
    kind: ScoreKind  # resolved: never AUTO
    candidates: tuple[Candidate, ...]  # normalized_score set


def normalize(
    scores: Sequence[float | None],
    kind: ScoreKind,
) -> tuple[list[float | None], ScoreKind]:
    """Scores on 0..1 and the kind they were read as; `None` stays `None`."""
    given = [x for x in scores if x is not None]
    if kind is ScoreKind.AUTO:
        if not given or (min(given) >= 0.0 and max(given) <= 1.0):
            # Read as similarities, which are on 0..1 already: nothing to clamp.
            return list(scores), ScoreKind.SIMILARITY
        kind = ScoreKind.LEXICAL
    if not given:
        return list(scores), kind
    if kind is ScoreKind.SIMILARITY:
        return [None if x is None else min(max(x, 0.0), 1.0) for x in scores], kind
    lo, hi = min(given), max(given)
    span = hi - lo
    if math.isinf(span):
        # Finite ends of opposite signs near the float limit (+-1.7e308): the difference
        # overflows and every score would be NaN. Halved, none of it can.
        lo, hi = lo / 2, hi / 2
        span = hi - lo
        scores = [None if x is None else x / 2 for x in scores]
    return [None if x is None else (1.0 if span == 0 else (x - lo) / span) for x in scores], kind


def rank_bonus(rank: int) -> float:
    if rank == 1:
        return 0.05
    return 0.02 if rank <= 3 else 0.0


def shape(query: Request) -> Shaped:
    sources = _sources(query)
    fused = bool(query.lists)
    everything = [c for src in sources for c in src.candidates]
    occurrences = len(everything)
    if not fused and not query.dedup_key:
        # One list, whose ids validation has held unique: the common case, with nothing
        # to merge or fuse.
        ordered, distinct = sorted(everything, key=_BY_RANK), occurrences
    else:
        ordered, distinct = _merged(query, sources, everything)

    report = None
    kept = ordered
    if query.threshold is not None:
        kept, report = apply_threshold(ordered, query.threshold, query.top_k)
    return Shaped(
        tuple(kept),
        deduplicated=occurrences - distinct,
        filtered=len(ordered) - len(kept),
        threshold=report,
        lexical_top=_lexical_top(sources),
    )


def _merged(
    query: Request,
    sources: list[_Source],
    everything: list[Candidate],
) -> tuple[list[Candidate], int]:
    """Occurrences of one document merged, lists fused (by weighted reciprocal rank, when
    there are lists), in retrieval order; and how many distinct documents there are."""
    fused = bool(query.lists)
    groups = _groups(everything, query.dedup_key)
    source_of = {c.index: src for src in sources for c in src.candidates}

    merged: list[tuple[Candidate, float]] = []
    for members in groups:
        best = (
            members[0]
            if len(members) == 1
            else min(members, key=lambda c: (c.retrieval_rank, c.index))
        )
        # One list: every candidate already names it (`_sources`).
        names = (
            best.found_in
            if len(sources) == 1
            else tuple(
                dict.fromkeys(
                    src.name for src in sources if any(source_of[m.index] is src for m in members)
                )
            )
        )
        score = 0.0
        if fused:
            k = query.fusion_k
            terms: list[float] = []
            for src in sources:
                ranks = [m.retrieval_rank for m in members if source_of[m.index] is src]
                if ranks and src.weight > 0:  # a list of weight 0 counts for nothing
                    terms += (src.weight / (k + min(ranks)), rank_bonus(min(ranks)))
            # Summed exactly (then rounded once), so that equal terms added in another
            # order (x, y, z each first in one of three lists) tie, and the tie-break
            # below decides rather than the last bit of a running sum.
            score = math.fsum(terms)
        # Most groups are one occurrence, already marked with its list (`_sources`).
        merged.append((best if best.found_in == names else best._replace(found_in=names), score))

    if fused:
        merged.sort(key=lambda cs: (-cs[1], cs[0].retrieval_rank, cs[0].index))
        top = merged[0][1] if merged else 1.0
        ordered = [
            c._replace(retrieval_rank=i + 1, normalized_score=score / top if top > 0 else 0.0)
            for i, (c, score) in enumerate(merged)
        ]
    else:
        ordered = sorted((c for c, _ in merged), key=_BY_RANK)
    return ordered, len(groups)


def _sources(query: Request) -> list[_Source]:
    lists: list[RankedList] = []
    if query.candidates or not query.lists:
        lists.append(
            RankedList(
                IMPLICIT_LIST,
                query.candidates,
                query.candidates_weight,
                score_kind=query.score_kind,
            )
        )
    lists.extend(query.lists)
    sources = []
    for lst in lists:
        scores, kind = normalize([c.retrieval_score for c in lst.candidates], lst.score_kind)
        weight = query.candidates_weight if lst.weight is None else lst.weight  # resolved
        # `found_in` names lists only when there are lists (the proto's word): the
        # implicit list of a plain request is not worth naming in every result.
        found_in = (lst.name,) if query.lists else ()
        candidates = tuple(
            [_shaped(c, s, found_in) for c, s in zip(lst.candidates, scores, strict=True)]
        )
        sources.append(_Source(lst.name, weight, kind, candidates))
    return sources


def _shaped(
    c: Candidate,
    normalized_score: float | None,
    found_in: tuple[str, ...],
) -> Candidate:
    """`c` with its shaping fields set: `c._replace` without its keyword handling, and
    built with `tuple.__new__` rather than the named tuple's constructor (a quarter of
    `_replace`'s cost; a test holds the two equal)."""
    return _new(
        Candidate,
        (
            c.id,
            c.text,
            c.index,
            c.retrieval_rank,
            c.title,
            c.retrieval_score,
            c.metadata,
            normalized_score,
            found_in,
        ),
    )


_new = tuple.__new__


def _groups(candidates: list[Candidate], dedup_key: str) -> list[list[Candidate]]:
    """Occurrences of the same document: linked by `id`, or by `metadata[dedup_key]`."""
    if not dedup_key and len({c.id for c in candidates}) == len(candidates):
        return [[c] for c in candidates]  # nothing to merge: the common case
    parent = list(range(len(candidates)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first_by: dict[tuple[str, str], int] = {}
    for i, c in enumerate(candidates):
        keys = [("id", c.id)]
        if dedup_key and c.metadata.get(dedup_key):  # an empty value is no value
            keys.append(("key", c.metadata[dedup_key]))
        for key in keys:
            j = first_by.setdefault(key, i)
            parent[find(i)] = find(j)
    groups: dict[int, list[Candidate]] = {}
    for i, c in enumerate(candidates):
        groups.setdefault(find(i), []).append(c)
    return list(groups.values())


def apply_threshold(
    ordered: list[Candidate],
    spec: ThresholdSpec,
    top_k: int,
) -> tuple[list[Candidate], ThresholdReport]:
    """Keep the candidates whose normalized score passes; see `Threshold` in the proto."""

    def passing(t: float) -> list[Candidate]:
        return [c for c in ordered if (c.normalized_score or 0.0) >= t - _EPS]

    if spec.mode is ThresholdMode.FIXED:
        t = FIXED_DEFAULT if spec.min_score is None else spec.min_score
        kept = passing(t)
        return kept, ThresholdReport(t, 0, len(kept))

    start = _or(spec.start, "start")
    step = _or(spec.step, "step")
    floor = _or(spec.floor, "floor")
    fraction = _or(spec.target_fraction, "target_fraction")
    need = min(len(ordered), max(1, math.ceil(fraction * (top_k or len(ordered)))))
    # Counted by bisection over the sorted scores: up to (start - floor) / step steps
    # (1,000 at the smallest step validation allows) of up to 900 candidates.
    scores = sorted(c.normalized_score or 0.0 for c in ordered)
    t, steps, reached_floor = start, 0, False
    while len(scores) - bisect.bisect_left(scores, t - _EPS) < need:
        if t <= floor + _EPS:
            reached_floor = True
            break
        # The last step lands on the floor itself: stepping only by whole steps, a floor
        # between two of them would never be tried, and what passes it would be dropped.
        t, steps = max(round(t - step, 9), floor), steps + 1
    kept = passing(t)
    if not kept and ordered:
        # At the floor with nothing passing: keep the best found rather than nothing.
        best = {c.index for c in sorted(ordered, key=lambda c: -(c.normalized_score or 0.0))[:need]}
        kept = [c for c in ordered if c.index in best]
    return kept, ThresholdReport(t, steps, len(kept), reached_floor)


def _or(value: float | None, name: str) -> float:
    return ADAPTIVE_DEFAULTS[name] if value is None else value


def _lexical_top(sources: list[_Source]) -> tuple[float, float] | None:
    for src in sources:
        if src.kind is not ScoreKind.LEXICAL:
            continue
        scores = sorted(
            (c.normalized_score for c in src.candidates if c.normalized_score is not None),
            reverse=True,
        )
        if len(scores) >= 2:
            return scores[0], scores[1]
    return None


def skip_reason(query: Request, shaped: Shaped) -> Degraded | None:
    """Why `shaped` is answered in retrieval order without scoring; None when it is scored."""
    rules = query.skip
    if rules.disabled:
        return Degraded(DegradedCode.DISABLED, "reranking is disabled on this server")
    n = len(shaped.candidates)
    if n < rules.min_candidates:
        return Degraded(
            DegradedCode.TOO_FEW_CANDIDATES,
            f"{n} candidates, fewer than min_candidates={rules.min_candidates}",
        )
    if rules.within_top_k and query.top_k and n <= query.top_k:
        return Degraded(
            DegradedCode.WITHIN_TOP_K, f"{n} candidates, no more than top_k={query.top_k}"
        )
    if rules.strong_signal and shaped.lexical_top is not None:
        top, second = shaped.lexical_top
        if top >= rules.strong_signal_min and top - second >= rules.strong_signal_gap:
            return Degraded(
                DegradedCode.STRONG_SIGNAL,
                f"lexical top score {top:.2f} leads the next by {top - second:.2f}",
            )
    return None
