"""Incremental final ordering: which results are certain while scoring is still running.

When a place is certain: docs/architecture.md, "Streaming: when is a position certain?".
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

from ..domain import BlendStrategy, Candidate, RankedCandidate
from . import blending


class Placed(NamedTuple):
    """A candidate whose final position is known.

    Its first three fields are its place in the final order, so a list of them sorts
    into that order as it is: blended score descending (stored negated), its place
    among equal scores (`tier_rank`), then position in the request, which is unique, so a
    comparison never reaches the candidate. One tuple per candidate, built with
    `tuple.__new__` (`_placed`): a named tuple's own constructor costs twice as much,
    and this is built for every candidate of every request."""

    neg_score: float
    # The retrieval rank; under `rerank_only`, a pair the model did not score comes after
    # every scored one, one it scored 0 included (`UNSCORED`).
    tier_rank: int
    index: int  # type: ignore[assignment]  # shadows tuple.index, which nothing calls
    candidate: Candidate
    reranker_score: float | None

    @property
    def score(self) -> float:
        """The blended score (negation is exact, so this is the score as blended)."""
        return -self.neg_score


def _placed(score: float, c: Candidate, reranker_score: float | None) -> Placed:
    return _new(Placed, (-score, c.retrieval_rank, c.index, c, reranker_score))


def _unscored(c: Candidate) -> Placed:
    """A pair the model did not score under `rerank_only`: score 0, after every scored
    candidate (scores lie on 0..1, so a scored 0 ties it otherwise), in retrieval order."""
    return _new(Placed, (-0.0, UNSCORED + c.retrieval_rank, c.index, c, None))


_new = tuple.__new__
UNSCORED = 1 << 62  # added to an unscored pair's rank: past every real rank (int64)


class IncrementalRanking:
    """Releases candidates in final order as their pair outcomes arrive."""

    def __init__(
        self,
        strategy: BlendStrategy,
        scored: list[Candidate],
        tail: list[Candidate],
        params: Callable[[], blending.AdaptiveParams] = lambda: blending.ADAPTIVE,
    ) -> None:
        self._strategy = strategy
        # The request-wide blends' parameters, asked for only once they settle: a profile
        # is chosen by the model's name, which the backend's answers may tell.
        self._params = params
        self._request_wide = strategy in blending.REQUEST_WIDE
        self._tail = tail
        # Outstanding candidates by their upper bound, best first, as (-bound, retrieval
        # rank, index): the key a `Placed` starts with. Stale entries are skipped lazily
        # once their candidate resolves.
        self._pending: dict[int, Candidate] = {c.index: c for c in scored}
        # A request-wide blend holds every outcome until it settles, so it needs no
        # bounds until then (`_settle` sets them when it settles early).
        self._bounds: list[tuple[float, int, int]] = (
            []
            if self._request_wide
            else [
                (-blending.upper_bound(strategy, c.retrieval_rank), c.retrieval_rank, c.index)
                for c in scored
            ]
        )
        heapq.heapify(self._bounds)
        self._resolved: list[Placed] = []  # a heap while anything is outstanding
        self._tail_released = False
        # Request-wide blends: those resolved before the blend settled, and the blend.
        self._held: list[tuple[Candidate, float | None]] = []
        self._settled: blending.Settled | None = None
        self.reranker_weight: float | None = None  # set when a request-wide blend settles

    @property
    def outstanding(self) -> int:
        return len(self._pending)

    def resolve(self, candidate_index: int, reranker_score: float | None) -> None:
        """Record a pair's outcome: its score, or `None` when it failed."""
        self.resolve_all(((candidate_index, reranker_score),))

    def resolve_all(self, outcomes: Iterable[tuple[int, float | None]]) -> None:
        """Record pairs' outcomes (candidate index, score or `None`) that arrived together.
        A request-wide blend settles once the last is in, or at the first when its
        parameters give the model no weight."""
        pending, held = self._pending, self._held
        if self._request_wide and self._settled is None:
            before = len(held)
            for candidate_index, reranker_score in outcomes:
                held.append((pending.pop(candidate_index), reranker_score))
            # Only once something arrived: an empty group (no cache hits) settles nothing.
            if len(held) > before and (not pending or self._params().max_weight == 0.0):
                self._settle()
            return
        rerank_only = self._strategy is BlendStrategy.RERANK_ONLY
        for candidate_index, reranker_score in outcomes:
            c = pending.pop(candidate_index)
            if rerank_only and reranker_score is None:
                heapq.heappush(self._resolved, _unscored(c))
                continue
            score = (
                self._settled.final(c.retrieval_rank, reranker_score)
                if self._settled
                else blending.blend(self._strategy, c.retrieval_rank, reranker_score)
            )
            heapq.heappush(self._resolved, _placed(score, c, reranker_score))

    def _settle(self) -> None:
        """Settle the blend on the scores in (all of them, or any when the model has no
        weight: then every final score is 1/rank), place what is held, and bound what is
        still outstanding."""
        scores = [p for _, p in self._held if p is not None]
        settled = (
            blending.Settled.on(scores, self._params())
            if not self._pending
            else blending.Settled.weighted(0.0, scores)
        )
        self._settled, self.reranker_weight = settled, settled.weight
        held, resolved = self._held, self._resolved
        finals = settled.finals([(c.retrieval_rank, p) for c, p in held])
        new = _new
        for (c, p), score in zip(held, finals, strict=True):  # `_placed` inline
            resolved.append(new(Placed, (-score, c.retrieval_rank, c.index, c, p)))
        held.clear()
        if self._pending:  # else `release` sorts them all at once
            heapq.heapify(resolved)
            self._bounds = [
                (-settled.upper_bound(c.retrieval_rank), c.retrieval_rank, c.index)
                for c in self._pending.values()
            ]
            heapq.heapify(self._bounds)

    def fail_outstanding(self) -> list[int]:
        """Resolve every outstanding pair as failed (deadline, backend gone); their indexes."""
        indexes = sorted(self._pending)
        self.resolve_all((i, None) for i in indexes)
        return indexes

    def release(self) -> list[Placed]:
        """Candidates whose position is now certain, in final order (each only once)."""
        resolved, pending = self._resolved, self._pending
        if not pending:
            # Nothing outstanding, so everything resolved is certain: one sort instead of
            # a pop and a bound check per candidate (a batch that lands whole, and the end
            # of every request).
            resolved.sort()
            out, self._resolved = resolved, []
            if not self._tail_released:
                self._tail_released = True
                out.extend(_placed(0.0, c, None) for c in self._tail)
            return out
        out = []
        bounds = self._bounds
        while resolved:
            while bounds and bounds[0][2] not in pending:
                heapq.heappop(bounds)
            # Keys sort ascending, so "a beats b" is key(a) < key(b); the bound's key is
            # a placed candidate's first three fields, and never equal to another's.
            if bounds and bounds[0] < resolved[0][:3]:
                break
            out.append(heapq.heappop(resolved))
        return out


class Emitter:
    """Numbers released candidates 1, 2, ... and stops yielding after `top_k` (0 = all)."""

    def __init__(self, top_k: int, texts: Mapping[int, str] | None = None) -> None:
        self._top_k = top_k
        self._next_rank = 1
        self._texts = texts or {}  # candidate index -> scored text (return_text)
        self._cached: set[int] = set()  # candidate indexes scored from the cache

    def mark_cached(self, indexes: Iterable[int]) -> None:
        self._cached.update(indexes)

    def take(self, placed: list[Placed]) -> list[RankedCandidate]:
        first = self._next_rank
        if self._top_k:
            placed = placed[: max(0, self._top_k - first + 1)]
        self._next_rank = first + len(placed)
        texts, cached, new = self._texts, self._cached, _new
        # Built with `tuple.__new__`, fields in `RankedCandidate`'s order (see `Placed`).
        return [
            new(
                RankedCandidate,
                (c, rank, -neg_score, p, texts.get(index) if texts else None, index in cached),
            )
            for rank, (neg_score, _, index, c, p) in enumerate(placed, first)
        ]
