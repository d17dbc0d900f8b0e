"""The reranking pipeline: cap, chunk, score within the budget, blend, release in order.

`Reranker.run` is an async generator of `RankedCandidate`s in final order followed by one
`RerankSummary`. Streaming RPCs forward each item as it comes; unary RPCs collect them.
Scorer trouble never raises from here: failed pairs are counted, and when no pair was
scored the answer is the retrieval order with `reranked = False` and the reason.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import Counter
from collections.abc import AsyncIterator

import structlog
from opentelemetry import trace

from ..domain import (
    BlendStrategy,
    Candidate,
    Degraded,
    DegradedCode,
    RankedCandidate,
    RerankQuery,
    RerankSummary,
)
from ..observability.metrics import CACHE_RESULT
from ..observability.telemetry import Telemetry
from ..scoring import prompt
from ..scoring.base import Failure, PairOutcome, Scorer, ScoreRequest
from ..settings import Settings
from . import blend_profiles
from .blend_profiles import BlendProfiles
from .blending import ADAPTIVE, AdaptiveParams
from .chunking import select_chunks
from .ordering import IncrementalRanking, Placed
from .score_cache import ScoreCache, cache_key
from .shaping import Shaped, shape

log = structlog.get_logger(__name__)

# Share of the caller's remaining deadline kept back for blending and sending the answer.
DEADLINE_RESERVE_FRACTION = 0.1
DEADLINE_RESERVE_MAX_S = 0.05


class Reranker:
    """Runs requests through the pipeline against one scorer."""

    def __init__(self, settings: Settings, scorer: Scorer,
                 telemetry: Telemetry | None = None, cache: ScoreCache | None = None,
                 profiles: BlendProfiles | None = None) -> None:
        self.settings = settings
        self.scorer = scorer
        self.telemetry = telemetry or Telemetry.disabled()
        self.cache = cache if cache is not None else ScoreCache(0, 0)  # empty is falsy
        self.profiles = profiles if profiles is not None \
            else blend_profiles.load(settings.blend_profile)
        self._unprofiled: set[tuple[str, str]] = set()  # (backend, model) already logged

    def blend_for(self, strategy: BlendStrategy,
                  ) -> tuple[BlendStrategy, AdaptiveParams, str]:
        """(strategy, request-wide parameters, profile name) that will blend a request.

        `PROFILE` becomes the profile matching the scorer's backend and model, or the
        built-in adaptive blend when none matches (or the model is not known yet).
        """
        if strategy is not BlendStrategy.PROFILE:
            return strategy, ADAPTIVE, ""
        kind, model = self.scorer.kind, self.scorer.model
        profile = self.profiles.find(kind, model)
        if profile is not None:
            return strategy, profile.params, profile.name
        if (kind, model) not in self._unprofiled:
            self._unprofiled.add((kind, model))
            log.info("no_blend_profile", backend=kind, model=model,
                        profiles=self.profiles.source, using=BlendStrategy.ADAPTIVE.value)
        return BlendStrategy.ADAPTIVE, ADAPTIVE, ""

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
        requested = query.blend or s.blend_strategy
        blend = _Blend(self, requested)
        with tracer.start_as_current_span("rerank.shape") as span:
            shaped = shape(query, s)
            cap = query.max_candidates or s.max_candidates
            scored_set, tail = list(shaped.candidates[:cap]), list(shaped.candidates[cap:])
            ranking = IncrementalRanking(requested, scored_set, tail, blend.params)
            skip = self._skip_reason(query, shaped)
            span.set_attributes({"rerank.candidates": query.occurrences,
                                 "rerank.deduplicated": shaped.deduplicated,
                                 "rerank.filtered": shaped.filtered,
                                 "rerank.submitted": 0 if skip else len(scored_set),
                                 "rerank.blend": requested.value})
            if skip is not None:
                span.set_attribute("rerank.skipped", skip.code.value)
        summary = functools.partial(self._summary, query, shaped, blend, ranking, started)
        emitter = _Emitter(query.top_k)

        if skip is not None:
            ranking.fail_outstanding()
            for item in emitter.take(ranking.release()):
                yield item
            yield summary(skip, submitted=0, scored=0, cached=0, failures=Counter(),
                          scoring_s=0.0)
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
        if query.return_text:
            emitter.texts = {c.index: doc for c, doc in zip(scored_set, documents, strict=True)}
        instruction = query.instruction or s.instruction

        # Pairs the cache already knows are resolved before anything is sent.
        keys = [cache_key(self.scorer.kind, self.scorer.model, instruction, query.query, doc)
                for doc in documents] if self.cache.enabled else []
        hits = {} if query.bypass_cache or not keys else await self.cache.get_many(keys)
        for i, key in enumerate(keys):
            if key in hits:
                ranking.resolve(scored_set[i].index, hits[key])
                emitter.cached.add(scored_set[i].index)
        if keys:
            self._count_lookups(len(keys) - len(hits), hits=len(hits), bypass=query.bypass_cache)
        for item in emitter.take(ranking.release()):
            yield item
        pending = [i for i, key in enumerate(keys) if key not in hits] if keys \
            else list(range(len(documents)))

        failures: Counter[Failure] = Counter()
        fresh: dict[int, float] = {}  # position in scored_set -> score
        scoring_started = time.perf_counter()
        if pending:
            request = ScoreRequest(query.query, instruction, [documents[i] for i in pending])
            budget = self.budget_s(query, deadline_remaining_s)
            async for i, outcome in self._score(request, scored_set, pending, ranking,
                                                failures, budget):
                if outcome.failure is None and outcome.score is not None:
                    fresh[i] = outcome.score
                for item in emitter.take(ranking.release()):
                    yield item
        scoring_s = time.perf_counter() - scoring_started
        if keys and fresh:
            # Keyed by the model now known: a backend that reports its model only in its
            # answers (llama-server without --model) would otherwise store under "".
            self.cache.put_many({
                cache_key(self.scorer.kind, self.scorer.model, instruction, query.query,
                          documents[i]): score for i, score in fresh.items()})

        # Results whose place was certain were blended and sent during scoring already.
        with tracer.start_as_current_span("rerank.blend") as span:
            final = emitter.take(ranking.release())
            span.set_attributes({"rerank.released_after_scoring": len(final),
                                 "rerank.blend": blend.strategy.value,
                                 "rerank.blend_profile": blend.profile})
            if ranking.reranker_weight is not None:
                span.set_attribute("rerank.reranker_weight", ranking.reranker_weight)
        for item in final:
            yield item
        scored = len(fresh) + len(hits)
        yield summary(_degraded(len(scored_set), scored, failures), submitted=len(scored_set),
                      scored=scored, cached=len(hits), failures=failures, scoring_s=scoring_s)

    async def _score(self, request: ScoreRequest, scored_set: list[Candidate],
                     pending: list[int], ranking: IncrementalRanking,
                     failures: Counter[Failure], budget_s: float,
                     ) -> AsyncIterator[tuple[int, PairOutcome]]:
        """Run the scorer within the budget; yields (position in scored set, outcome).

        Every outcome is resolved in `ranking` before it is yielded; pairs that time out
        or that a crashed scorer never reported are failed and counted in `failures`.
        The budget bounds only the waits, never the caller's work between yields: a
        timeout that fired while the caller wrote a stream message would cancel the RPC.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + budget_s
        outcomes: asyncio.Queue[PairOutcome] = asyncio.Queue()
        # Not a `with` block: the span must not stay current across the yields below. The
        # scorer task copies the context at creation, so backend calls become its children.
        span = self.telemetry.tracer.start_span("rerank.score", attributes={
            "rerank.backend": self.scorer.kind, "rerank.pairs": len(pending)})
        with trace.use_span(span, end_on_exit=False):
            task = asyncio.create_task(self.scorer.score(request, outcomes.put_nowait))
        scored = 0
        try:
            while ranking.outstanding:
                outcome = await asyncio.wait_for(_next_outcome(outcomes, task),
                                                 max(deadline - loop.time(), 0))
                if outcome is None:  # scorer returned without reporting every pair
                    failures.update(_fail_rest(ranking, Failure.MALFORMED))
                    break
                i = pending[outcome.pair]
                ranking.resolve(scored_set[i].index, outcome.score)
                if outcome.failure is None:
                    scored += 1
                else:
                    failures[outcome.failure] += 1
                yield i, outcome
        except TimeoutError:
            failures.update(_fail_rest(ranking, Failure.TIMEOUT))
        except _ScorerCrashed as crash:
            log.error("scorer_crashed", backend=self.scorer.kind, error=crash.detail)
            failures.update(_fail_rest(ranking, Failure.HTTP_ERROR))
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            span.set_attributes({"rerank.model": self.scorer.model, "rerank.scored": scored,
                                 "rerank.failed": sum(failures.values())})
            span.end()

    def _count_lookups(self, misses: int, *, hits: int, bypass: bool) -> None:
        lookups = self.telemetry.metrics.cache_lookups
        if bypass:
            lookups.add(misses, {CACHE_RESULT: "bypass"})
            return
        lookups.add(hits, {CACHE_RESULT: "hit"})
        lookups.add(misses, {CACHE_RESULT: "miss"})

    def _skip_reason(self, query: RerankQuery, shaped: Shaped) -> Degraded | None:
        s = self.settings
        if s.disabled:
            return Degraded(DegradedCode.DISABLED, "reranking is disabled on this server")
        n = len(shaped.candidates)
        if n < s.min_candidates:
            return Degraded(DegradedCode.TOO_FEW_CANDIDATES,
                            f"{n} candidates, fewer than min_candidates={s.min_candidates}")
        within = s.skip_within_top_k if query.skip_within_top_k is None \
            else query.skip_within_top_k
        if within and query.top_k and n <= query.top_k:
            return Degraded(DegradedCode.WITHIN_TOP_K,
                            f"{n} candidates, no more than top_k={query.top_k}")
        strong = s.strong_signal_skip if query.strong_signal_skip is None \
            else query.strong_signal_skip
        if strong and shaped.lexical_top is not None:
            top, second = shaped.lexical_top
            if top >= s.strong_signal_min and top - second >= s.strong_signal_gap:
                return Degraded(DegradedCode.STRONG_SIGNAL,
                                f"lexical top score {top:.2f} leads the next by "
                                f"{top - second:.2f}")
        return None

    def _summary(self, query: RerankQuery, shaped: Shaped, blend: _Blend,
                 ranking: IncrementalRanking, started: float, degraded: Degraded | None, *,
                 submitted: int, scored: int, cached: int, failures: Counter[Failure],
                 scoring_s: float) -> RerankSummary:
        return RerankSummary(
            request_id=query.request_id, reranked=scored > 0, degraded=degraded,
            backend=self.scorer.kind, model=self.scorer.model, blend=blend.strategy,
            candidates=query.occurrences, submitted=submitted, scored=scored,
            failed=sum(failures.values()),
            total_ms=(time.perf_counter() - started) * 1000, scoring_ms=scoring_s * 1000,
            failures={failure.value: n for failure, n in failures.items()}, cached=cached,
            deduplicated=shaped.deduplicated, filtered=shaped.filtered,
            threshold=shaped.threshold, blend_profile=blend.profile,
            reranker_weight=ranking.reranker_weight if scored else None)


class _Blend:
    """A request's blend, settled on first use after scoring (see `Reranker.blend_for`):
    by then the backend's answers have named its model."""

    def __init__(self, reranker: Reranker, requested: BlendStrategy) -> None:
        self._reranker = reranker
        self._requested = requested

    @functools.cached_property
    def _settled(self) -> tuple[BlendStrategy, AdaptiveParams, str]:
        return self._reranker.blend_for(self._requested)

    def params(self) -> AdaptiveParams:
        return self._settled[1]

    @property
    def strategy(self) -> BlendStrategy:
        return self._settled[0]

    @property
    def profile(self) -> str:
        return self._settled[2]


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
        self.texts: dict[int, str] = {}  # candidate index -> scored text (return_text)
        self.cached: set[int] = set()  # candidate indexes scored from the cache

    def take(self, placed: list[Placed]) -> list[RankedCandidate]:
        out: list[RankedCandidate] = []
        for p in placed:
            if self._top_k and self._next_rank > self._top_k:
                break
            index = p.candidate.index
            out.append(RankedCandidate(
                candidate=p.candidate, rank=self._next_rank, score=p.score,
                reranker_score=p.reranker_score, scored_text=self.texts.get(index),
                cached=index in self.cached))
            self._next_rank += 1
        return out
