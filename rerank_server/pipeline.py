"""The reranking pipeline: cap, chunk, score within the budget, blend, release in order.

`Reranker.run` is an async generator of `RankedCandidate`s in final order followed by one
`RerankSummary`. Streaming RPCs forward each item as it comes; unary RPCs collect them.
Scorer trouble never raises from here: failed pairs are counted, and when no pair was
scored the answer is the retrieval order with `reranked = False` and the reason.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator

import structlog
from opentelemetry import trace

from . import prompt
from .chunking import select_chunks
from .domain import (
    BlendStrategy,
    Degraded,
    DegradedCode,
    RankedCandidate,
    RerankQuery,
    RerankSummary,
)
from .ordering import IncrementalRanking, Placed
from .scoring.base import Failure, PairOutcome, Scorer, ScoreRequest
from .settings import Settings
from .telemetry import Telemetry

log = structlog.get_logger(__name__)

# Share of the caller's remaining deadline kept back for blending and sending the answer.
DEADLINE_RESERVE_FRACTION = 0.1
DEADLINE_RESERVE_MAX_S = 0.05


class Reranker:
    """Runs requests through the pipeline against one scorer."""

    def __init__(self, settings: Settings, scorer: Scorer,
                 telemetry: Telemetry | None = None) -> None:
        self.settings = settings
        self.scorer = scorer
        self.telemetry = telemetry or Telemetry.disabled()

    def budget_s(self, query: RerankQuery, deadline_remaining_s: float | None) -> float:
        """Seconds the scorer may use: the smallest of server default, request, deadline."""
        budget = self.settings.timeout_ms / 1000
        if query.timeout_s is not None:
            budget = min(budget, query.timeout_s)
        if deadline_remaining_s is not None:
            reserve = min(DEADLINE_RESERVE_MAX_S, deadline_remaining_s * DEADLINE_RESERVE_FRACTION)
            budget = min(budget, deadline_remaining_s - reserve)
        return max(budget, 0.0)

    async def run(self, query: RerankQuery, deadline_remaining_s: float | None = None,
                  ) -> AsyncIterator[RankedCandidate | RerankSummary]:
        started = time.perf_counter()
        s = self.settings
        tracer = self.telemetry.tracer
        strategy = query.blend or s.blend_strategy
        with tracer.start_as_current_span("rerank.shape") as span:
            by_rank = sorted(query.candidates, key=lambda c: (c.retrieval_rank, c.index))
            cap = query.max_candidates or s.max_candidates
            scored_set, tail = by_rank[:cap], by_rank[cap:]
            ranking = IncrementalRanking(strategy, scored_set, tail)
            skip = self._skip_reason(query)
            span.set_attributes({"rerank.candidates": len(query.candidates),
                                 "rerank.submitted": 0 if skip else len(scored_set),
                                 "rerank.blend": strategy.value})
            if skip is not None:
                span.set_attribute("rerank.skipped", skip.code.value)
        emitter = _Emitter(query.top_k)

        if skip is not None:
            ranking.fail_outstanding()
            for item in emitter.take(ranking.release(), {}):
                yield item
            yield self._summary(query, strategy, started, skip, submitted=0, scored=0,
                                failures=Counter(), scoring_s=0.0)
            return

        max_chunk = query.max_chunk_chars or s.max_chunk_chars
        with tracer.start_as_current_span("rerank.chunk") as span:
            chunks = select_chunks(query.query, [c.text for c in scored_set], max_chunk)
            documents = [prompt.document_text(chunk, c.title)
                         for chunk, c in zip(chunks, scored_set, strict=True)]
            span.set_attributes({
                "rerank.max_chunk_chars": max_chunk,
                "rerank.chunked": sum(len(chunk) < len(c.text)
                                      for chunk, c in zip(chunks, scored_set, strict=True))})
        texts = ({c.index: doc for c, doc in zip(scored_set, documents, strict=True)}
                 if query.return_text else {})
        request = ScoreRequest(query.query, query.instruction or s.instruction, documents)

        failures: Counter[Failure] = Counter()
        scored = 0
        scoring_started = time.perf_counter()
        outcomes: asyncio.Queue[PairOutcome] = asyncio.Queue()
        # Not a `with` block: the span must not stay current across the yields below. The
        # scorer task copies the context at creation, so backend calls become its children.
        score_span = tracer.start_span("rerank.score", attributes={
            "rerank.backend": self.scorer.kind, "rerank.pairs": len(documents)})
        with trace.use_span(score_span, end_on_exit=False):
            task = asyncio.create_task(self.scorer.score(request, outcomes.put_nowait))
        try:
            async with asyncio.timeout(self.budget_s(query, deadline_remaining_s)):
                while ranking.outstanding:
                    outcome = await _next_outcome(outcomes, task)
                    if outcome is None:  # scorer returned without reporting every pair
                        failures.update(_fail_rest(ranking, Failure.MALFORMED))
                        break
                    ranking.resolve(scored_set[outcome.pair].index, outcome.score)
                    if outcome.failure is None:
                        scored += 1
                    else:
                        failures[outcome.failure] += 1
                    for item in emitter.take(ranking.release(), texts):
                        yield item
        except TimeoutError:
            failures.update(_fail_rest(ranking, Failure.TIMEOUT))
        except _ScorerCrashed as crash:
            log.error("scorer_crashed", backend=self.scorer.kind, error=crash.detail)
            failures.update(_fail_rest(ranking, Failure.HTTP_ERROR))
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            score_span.set_attributes({"rerank.model": self.scorer.model,
                                       "rerank.scored": scored,
                                       "rerank.failed": sum(failures.values())})
            score_span.end()
        scoring_s = time.perf_counter() - scoring_started

        # Results whose place was certain were blended and sent during scoring already.
        with tracer.start_as_current_span("rerank.blend") as span:
            final = emitter.take(ranking.release(), texts)
            span.set_attribute("rerank.released_after_scoring", len(final))
        for item in final:
            yield item
        degraded = _degraded(len(scored_set), scored, failures)
        yield self._summary(query, strategy, started, degraded, submitted=len(scored_set),
                            scored=scored, failures=failures, scoring_s=scoring_s)

    def _skip_reason(self, query: RerankQuery) -> Degraded | None:
        if self.settings.disabled:
            return Degraded(DegradedCode.DISABLED, "reranking is disabled on this server")
        n, least = len(query.candidates), self.settings.min_candidates
        if n < least:
            return Degraded(DegradedCode.TOO_FEW_CANDIDATES,
                            f"{n} candidates, fewer than min_candidates={least}")
        return None

    def _summary(self, query: RerankQuery, strategy: BlendStrategy, started: float,
                 degraded: Degraded | None, *, submitted: int, scored: int,
                 failures: Counter[Failure], scoring_s: float) -> RerankSummary:
        return RerankSummary(
            request_id=query.request_id, reranked=scored > 0, degraded=degraded,
            backend=self.scorer.kind, model=self.scorer.model, blend=strategy,
            candidates=len(query.candidates), submitted=submitted, scored=scored,
            failed=sum(failures.values()),
            total_ms=(time.perf_counter() - started) * 1000, scoring_ms=scoring_s * 1000,
            failures={failure.value: n for failure, n in failures.items()})


class _ScorerCrashed(Exception):
    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


async def _next_outcome(outcomes: asyncio.Queue[PairOutcome],
                        task: asyncio.Task[None]) -> PairOutcome | None:
    """The next outcome; None once the scorer has finished and nothing is left."""
    if not outcomes.empty():
        return outcomes.get_nowait()
    getter = asyncio.ensure_future(outcomes.get())
    try:
        await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not getter.done():
            getter.cancel()
    if getter.done() and not getter.cancelled():
        return getter.result()
    if task.done() and not task.cancelled() and task.exception() is not None:
        exc = task.exception()
        raise _ScorerCrashed(type(exc).__name__)
    return outcomes.get_nowait() if not outcomes.empty() else None


def _fail_rest(ranking: IncrementalRanking, failure: Failure) -> Counter[Failure]:
    return Counter({failure: len(ranking.fail_outstanding())})


def _degraded(submitted: int, scored: int, failures: Counter[Failure]) -> Degraded | None:
    failed = sum(failures.values())
    if failed == 0:
        return None
    kinds = ", ".join(f"{kind.value}: {n}" for kind, n in failures.most_common())
    if scored == 0:
        main = failures.most_common(1)[0][0]
        return Degraded(main.degraded_code, f"all {submitted} pairs failed ({kinds})")
    return Degraded(DegradedCode.PARTIAL, f"{failed} of {submitted} pairs failed ({kinds})")


class _Emitter:
    """Numbers released candidates 1, 2, ... and stops yielding after `top_k` (0 = all)."""

    def __init__(self, top_k: int) -> None:
        self._top_k = top_k
        self._next_rank = 1

    def take(self, placed: list[Placed], texts: dict[int, str]) -> list[RankedCandidate]:
        out: list[RankedCandidate] = []
        for p in placed:
            if self._top_k and self._next_rank > self._top_k:
                break
            out.append(_ranked(p, self._next_rank, texts.get(p.candidate.index)))
            self._next_rank += 1
        return out


def _ranked(p: Placed, rank: int, text: str | None) -> RankedCandidate:
    return RankedCandidate(candidate=p.candidate, rank=rank, score=p.score,
                           reranker_score=p.reranker_score, scored_text=text)
