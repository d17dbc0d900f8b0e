"""The reranking pipeline: validate, shape, chunk, cache, score, blend, emit, one module
per step; scorer trouble degrades an answer and never raises from here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator, Callable

from opentelemetry import trace

from ..domain import (
    Candidate,
    Degraded,
    DegradedCode,
    RankedCandidate,
    RerankQuery,
    RerankSummary,
)
from ..observability.telemetry import Telemetry
from ..scoring.base import PairOutcome, Scorer, ScoreRequest
from ..scoring.budget import StopSignal, budget_s, score_within
from . import blend_profiles
from .blend_profiles import Blend, BlendResolver
from .blending import REQUEST_WIDE, scores_can_matter
from .chunk_thread import choose_chunks
from .ordering import Emitter, IncrementalRanking
from .outcome import ScoringOutcome, capped
from .pair_admission import PairAdmission
from .request import Request, RequestRules
from .score_cache import Lookup, Scope, ScoreCache
from .scripts import dominant_script
from .shaping import Shaped, shape, skip_reason
from .validation import resolve


class Reranker:
    """Runs requests through the pipeline against one scorer."""

    def __init__(
        self,
        rules: RequestRules,
        scorer: Scorer,
        telemetry: Telemetry | None = None,
        cache: ScoreCache | None = None,
        blends: BlendResolver | None = None,
        loop_lag: Callable[[], float] = lambda: 0.0,
        name: str = "",
        identity: str = "",
    ) -> None:
        self.rules = rules
        self.scorer = scorer
        # The name the model is served by (`--model NAME=SOURCE`), reported in answers
        # and keying its cached scores apart from another served model's; "" when the
        # server names none: the backend's own name for its model is reported.
        self.name = name
        # The model file's sha256 where the server knows it (managed mode): in the score
        # cache's keys, so that replicas serving different files under one name, or one
        # name given a new file, never share scores.
        self.identity = identity
        self.telemetry = telemetry or Telemetry.disabled()
        self.cache = cache if cache is not None else ScoreCache(0, 0)
        self.blends = blends or BlendResolver(blend_profiles.load())
        self._loop_lag = loop_lag
        # Set when the server shuts down: pairs still outstanding are given up at once.
        self.stopping = StopSignal()
        self.active = 0  # requests in the pipeline now
        self.admission = PairAdmission(scorer)

    @property
    def outstanding_pairs(self) -> int:
        """Pairs sent to scoring and not yet come back."""
        return self.admission.outstanding

    def stop_scoring_after(self, seconds: float) -> None:
        """Shutdown: in `seconds`, every request still waiting for scores answers with what
        it has (SHUTTING_DOWN), so answers leave before the grace period ends."""
        asyncio.get_running_loop().call_later(max(seconds, 0.0), self.stopping.set)

    def resolve(self, query: RerankQuery) -> Request:
        """`query` validated and resolved; raises `InvalidRequest`."""
        with self.telemetry.step("rerank.validate"):
            return resolve(query, self.rules)

    async def run(
        self,
        query: RerankQuery,
        deadline_remaining_s: float | None = None,
        request_span: trace.Span | None = None,
    ) -> AsyncGenerator[RankedCandidate | RerankSummary, None]:
        """The results as their places become certain, then the summary.

        `request_span`: the request's own span from the edge (`Telemetry.request_span`);
        its scoring is traced there instead of in a `rerank.score` span."""
        self.active += 1
        try:
            # Closed with this generator (a stream cancelled or left early), not later by
            # the loop's finalizer in a task of its own.
            async with contextlib.aclosing(
                self._run(query, deadline_remaining_s, request_span)
            ) as pipeline:
                async for released in pipeline:
                    if isinstance(released, RerankSummary):
                        yield released
                    else:
                        for item in released:
                            yield item
        finally:
            self.active -= 1

    async def answer(
        self,
        query: RerankQuery,
        deadline_remaining_s: float | None = None,
        request_span: trace.Span | None = None,
    ) -> tuple[list[RankedCandidate], RerankSummary]:
        """The whole answer at once (unary RPCs, the JSON API): results in final order and
        the summary.

        The pipeline is consumed to its end, not left after the summary: a generator left
        suspended is closed only when the event loop gets to its finalizer (a task per
        request), and until then `active` still counts the request."""
        # `_run` itself rather than `run`, which wraps it only to count `active` and to
        # hand the results over one at a time.
        self.active += 1
        results: list[RankedCandidate] = []
        summary = None
        try:
            async for released in self._run(query, deadline_remaining_s, request_span):
                if isinstance(released, RerankSummary):
                    summary = released  # the last item: the loop ends the generator
                else:
                    results += released
        finally:
            self.active -= 1
        if summary is None:
            raise RuntimeError("pipeline ended without a summary")
        return results, summary

    async def _run(
        self,
        query: RerankQuery,
        deadline_remaining_s: float | None,
        request_span: trace.Span | None,
    ) -> AsyncGenerator[list[RankedCandidate] | RerankSummary, None]:
        """The results in lists, as each group's places become certain (never an empty
        list), then the summary. Lists rather than one result at a time: a generator
        resumption per result would be the pipeline's largest fixed cost per candidate."""
        started = time.perf_counter()
        request = self.resolve(query)
        shaped, scored_set, tail, skip = self._shape(request)
        blend = self._blend(request, scored_set)
        skip = skip or self._without_weight(request, blend, scored_set)
        ranking = IncrementalRanking(request.blend, scored_set, tail, lambda: blend().params)
        outcome = ScoringOutcome(submitted=0 if skip else len(scored_set))
        if skip is not None:
            ranking.fail_outstanding()
            if released := Emitter(request.top_k).take(ranking.release()):
                yield released
            yield self._summary(request, shaped, blend(), ranking, outcome, (skip,), started)
            return

        documents = await self._chunk(request, scored_set, deadline_remaining_s, started)
        emitter = _emitter(request, scored_set, documents)
        scope = self._scope(request)
        looked_up = await self.cache.lookup(scope, documents, bypass=request.bypass_cache)
        _resolve_hits(looked_up.hits, scored_set, ranking, emitter, outcome)
        if released := emitter.take(ranking.release()):
            yield released

        pending = [i for i in range(len(documents)) if i not in looked_up.hits]
        fresh: dict[int, float] = {}  # position in `documents` -> score, for the cache
        scoring_started = time.perf_counter()
        budget = self._budget(request, started, scoring_started, deadline_remaining_s)
        overloaded = self.admission.refuse(len(pending), budget) if pending else None
        if overloaded is not None:
            ranking.fail_outstanding()  # answered at once, in retrieval order
            pending = []
            outcome.submitted = len(looked_up.hits)  # what was not sent was not submitted
        if pending:
            pairs = ScoreRequest(
                request.query,
                request.instruction,
                [documents[i] for i in pending],
                request.max_tokens_per_doc,
            )
            with self.admission.sent(len(pending)) as sent:
                async for arrived in score_within(
                    self.scorer,
                    pairs,
                    budget,
                    self.telemetry.tracer,
                    self.stopping,
                    request_span,
                    self.model,
                ):
                    sent.back(len(arrived))
                    ranking.resolve_all(_count(arrived, pending, scored_set, outcome, fresh))
                    if released := emitter.take(ranking.release()):
                        yield released
        outcome.scoring_s = time.perf_counter() - scoring_started
        outcome.scored += len(looked_up.hits)
        self._store(scope, looked_up, fresh)

        # Results whose place was certain were blended and sent during scoring already.
        final, settled = self._settle(emitter, ranking, blend)
        if final:
            yield final
        reasons = (overloaded, outcome.degraded(), capped(scored_set, tail))
        yield self._summary(request, shaped, settled, ranking, outcome, reasons, started)

    def _shape(
        self, request: Request
    ) -> tuple[Shaped, list[Candidate], list[Candidate], Degraded | None]:
        """The candidates shaped: those to score (up to `max_candidates`), the tail kept
        in retrieval order behind them, and why nothing is scored, if nothing is."""
        with self.telemetry.step("rerank.shape") as span:
            shaped = shape(request)
            cap = request.max_candidates
            scored_set, tail = list(shaped.candidates[:cap]), list(shaped.candidates[cap:])
            skip = skip_reason(request, shaped)
            if span.is_recording():
                span.set_attributes(
                    _shape_attributes(request, shaped, 0 if skip else len(scored_set))
                )
        return shaped, scored_set, tail, skip

    def _blend(self, request: Request, scored_set: list[Candidate]) -> Callable[[], Blend]:
        return self.blends.settle(
            request.blend,
            lambda: self.scorer.kind,
            lambda: self.scorer.model,
            lambda: dominant_script(request.query, (c.text for c in scored_set)),
        )

    def _without_weight(
        self, request: Request, blend: Callable[[], Blend], scored_set: list[Candidate]
    ) -> Degraded | None:
        """NO_RERANKER_WEIGHT when no score could change the answer. A profile is chosen
        by the model's name: while the backend has not told it, the pairs are sent (and
        the profile is chosen once their answers are in)."""
        if request.always_score or not (self.scorer.model or request.blend not in REQUEST_WIDE):
            return None
        return _no_reranker_weight(request, blend(), scored_set)

    async def _chunk(
        self,
        request: Request,
        scored_set: list[Candidate],
        deadline_remaining_s: float | None,
        started: float,
    ) -> list[str]:
        with self.telemetry.step("rerank.chunk") as span:
            documents, chunked, fell_back = await choose_chunks(
                request, scored_set, deadline_remaining_s, started
            )
            if fell_back:
                span.set_attribute("rerank.chunk_fallback", True)
            span.set_attributes(
                {"rerank.max_chunk_chars": request.max_chunk_chars, "rerank.chunked": chunked}
            )
        return documents

    def _scope(self, request: Request) -> Scope:
        """What a cached score is keyed by besides its text."""
        return Scope(
            self.scorer.kind,
            self._cache_model(),
            request.instruction,
            request.query,
            request.max_tokens_per_doc,
            self.scorer.variant,
            self.identity,
        )

    def _budget(
        self,
        request: Request,
        started: float,
        now: float,
        deadline_remaining_s: float | None,
    ) -> float:
        """Seconds the scoring may take. Counted from the request's arrival: chunking (a
        large request's can wait behind another's on the one chunking thread) and the
        cache lookup took their part of the deadline and of the timeout already, and a
        request that spent 0.6 s before scoring must not answer 0.6 s after a 1 s
        deadline."""
        elapsed = now - started
        return budget_s(
            request.timeout_s - elapsed,
            None if deadline_remaining_s is None else deadline_remaining_s - elapsed,
            self._loop_lag(),
            self.active,
        )

    def _store(self, scope: Scope, looked_up: Lookup, fresh: dict[int, float]) -> None:
        """The fresh scores into the cache, keyed by the model known now: a backend that
        names its model only in its answers (llama-server without --model) would
        otherwise store under "". Not stored when the variant changed meanwhile:
        `rerank` answers read as probabilities before the switch to logits would land
        under the logits' key."""
        if self.scorer.variant != scope.variant:
            return
        model = self._cache_model()
        self.cache.store(
            looked_up,
            scope if model == scope.model else dataclasses.replace(scope, model=model),
            fresh,
        )

    def _cache_model(self) -> str:
        """The model a cached score belongs to: the served name too, so that two served
        models whose backends report one name (two files called model.gguf) share none
        (the file's sha256, where known, is a key part of its own: `Scope.identity`)."""
        return f"{self.name}/{self.scorer.model}" if self.name else self.scorer.model

    @property
    def model(self) -> str:
        """The model's name in answers, logs and metrics."""
        return self.name or self.scorer.model

    def _settle(
        self, emitter: Emitter, ranking: IncrementalRanking, blend: Callable[[], Blend]
    ) -> tuple[list[RankedCandidate], Blend]:
        """What is left to release once scoring is over, and the blend it settled on."""
        with self.telemetry.step("rerank.blend") as span:
            final = emitter.take(ranking.release())
            settled = blend()
            span.set_attributes(
                {
                    "rerank.released_after_scoring": len(final),
                    "rerank.blend": settled.strategy.value,
                    "rerank.blend_profile": settled.profile,
                }
            )
            if ranking.reranker_weight is not None:
                span.set_attribute("rerank.reranker_weight", ranking.reranker_weight)
        return final, settled

    def _summary(
        self,
        request: Request,
        shaped: Shaped,
        blend: Blend,
        ranking: IncrementalRanking,
        outcome: ScoringOutcome,
        reasons: tuple[Degraded | None, ...],
        started: float,
    ) -> RerankSummary:
        """The request's summary; `reasons`: each reason it degraded, or None, in the
        order they are said (every one that holds, the first as `degraded`)."""
        return RerankSummary(
            request_id=request.request_id,
            reranked=outcome.scored > 0,
            degraded_reasons=tuple(r for r in reasons if r is not None),
            backend=self.scorer.kind,
            model=self.model,
            blend=blend.strategy,
            candidates=request.occurrences,
            submitted=outcome.submitted,
            scored=outcome.scored,
            failed=sum(outcome.failures.values()),
            total_ms=(time.perf_counter() - started) * 1000,
            scoring_ms=outcome.scoring_s * 1000,
            failures={failure.value: n for failure, n in outcome.failures.items()},
            cached=outcome.cached,
            deduplicated=shaped.deduplicated,
            filtered=shaped.filtered,
            threshold=shaped.threshold,
            blend_profile=blend.profile,
            reranker_weight=ranking.reranker_weight if outcome.scored else None,
        )


def _emitter(request: Request, scored_set: list[Candidate], documents: list[str]) -> Emitter:
    """Releases results in their final order; with `return_text`, each with the text
    the model read."""
    return Emitter(
        request.top_k,
        {c.index: d for c, d in zip(scored_set, documents, strict=True)}
        if request.return_text
        else None,
    )


def _resolve_hits(
    hits: dict[int, float],
    scored_set: list[Candidate],
    ranking: IncrementalRanking,
    emitter: Emitter,
    outcome: ScoringOutcome,
) -> None:
    """Pairs the cache knows are resolved before anything is sent."""
    ranking.resolve_all((scored_set[i].index, score) for i, score in hits.items())
    emitter.mark_cached(scored_set[i].index for i in hits)
    outcome.cached = len(hits)


def _count(
    arrived: list[PairOutcome],
    pending: list[int],
    scored_set: list[Candidate],
    outcome: ScoringOutcome,
    fresh: dict[int, float],
) -> list[tuple[int, float | None]]:
    """A group of outcomes counted, its scores kept for the cache; each candidate's
    index with its score (None: failed) for the ranking."""
    resolved = []
    for pair in arrived:
        i = pending[pair.pair]
        resolved.append((scored_set[i].index, pair.score))
        if outcome.count(pair) and pair.score is not None:
            fresh[i] = pair.score
    return resolved


def _no_reranker_weight(
    request: Request,
    blend: Blend,
    scored: list[Candidate],
) -> Degraded | None:
    """NO_RERANKER_WEIGHT when no score could change the answer: the pairs are not sent."""
    if scores_can_matter(
        blend.strategy, blend.params, [c.retrieval_rank for c in scored], request.top_k
    ):
        return None
    why = (
        f"blend profile {blend.profile} gives the reranker no weight{blend.note}"
        if blend.profile
        else f"no score can change the first {request.top_k} places under the "
        f"{blend.strategy.value} blend"
    )
    return Degraded(
        DegradedCode.NO_RERANKER_WEIGHT,
        f"{why}: retrieval order, no pair sent (always_score sends them)",
    )


def _shape_attributes(
    request: Request,
    shaped: Shaped,
    submitted: int,
) -> dict[str, str | int]:
    return {
        "rerank.candidates": request.occurrences,
        "rerank.deduplicated": shaped.deduplicated,
        "rerank.filtered": shaped.filtered,
        "rerank.submitted": submitted,
        "rerank.blend": request.blend.value,
    }
