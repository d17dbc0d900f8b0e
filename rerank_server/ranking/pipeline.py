"""The reranking pipeline: validate, shape, chunk, cache, score, blend, emit.

`Reranker.run` is an async generator of `RankedCandidate`s in final order followed by one
`RerankSummary`. Streaming RPCs forward each item as it comes; unary RPCs collect them.
Each step lives in its own module; this one only orchestrates them. Scorer trouble never
raises from here: failed pairs are counted, and when no pair was scored the answer is the
retrieval order with `reranked = False` and the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections import Counter
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TypeVar

import structlog
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
from ..scoring.base import Failure, Scorer, ScoreRequest
from ..scoring.budget import StopSignal, budget_s, score_within
from . import blend_profiles
from .blend_profiles import Blend, BlendResolver
from .blending import REQUEST_WIDE, scores_can_matter
from .chunking import CHUNK_ON_LOOP_CHARS, chars_to_chunk, document_texts, head_texts
from .ordering import Emitter, IncrementalRanking
from .request import Request, RequestRules
from .score_cache import Scope, ScoreCache
from .scripts import dominant_script
from .shaping import Shaped, shape, skip_reason
from .validation import resolve

T = TypeVar("T")
log = structlog.get_logger(__name__)


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
    ) -> None:
        self.rules = rules
        self.scorer = scorer
        self.telemetry = telemetry or Telemetry.disabled()
        self.cache = cache if cache is not None else ScoreCache(0, 0)
        self.blends = blends or BlendResolver(blend_profiles.load())
        self._loop_lag = loop_lag
        # Set when the server shuts down: pairs still outstanding are given up at once.
        self.stopping = StopSignal()
        self.active = 0  # requests in the pipeline now
        # Pairs admitted to scoring and not yet come back. Admission reads the backend's
        # queue, which a request's pairs reach only some turns of the loop after it was
        # admitted: a burst of requests arriving together each saw the same near-empty
        # queue, all were admitted, and all timed out instead of being answered
        # OVERLOADED at once.
        self.outstanding_pairs = 0
        self._last_unsure = -OWN_TIME_PROBE_S  # when a request too slow alone was last sent

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

    def _overloaded(self, pairs: int, budget_s: float) -> Degraded | None:
        """Why the request's pairs are not sent (None: they are). OVERLOADED when, behind
        the pairs queued and in flight ahead of it, the backend would not score them
        within the budget, less the headroom. With nothing ahead the wait would be the
        request's own: one such request in `OWN_TIME_PROBE_S` is sent (its budget
        decides what is scored, PARTIAL or TIMEOUT, and its answer corrects the
        estimate), the others are answered TIMEOUT at once. Before, they were all told
        OVERLOADED, "backend busy", and since a refused request sends nothing, one slow
        moment (a paused backend, a cold model's first call) that inflated the estimate
        refused every request of that size for good, the backend idle."""
        wait_s = self.scorer.estimate_s(pairs, self.outstanding_pairs)
        if wait_s <= budget_s * (1 - ADMISSION_HEADROOM):
            return None
        ahead_s = self.scorer.estimate_s(0, self.outstanding_pairs)
        if ahead_s > 0:
            return Degraded(
                DegradedCode.OVERLOADED,
                f"backend busy: about {_seconds(wait_s)} until these pairs "
                f"would be scored, {_seconds(ahead_s)} of it behind the pairs "
                f"ahead, past {1 - ADMISSION_HEADROOM:.0%} of the "
                f"{_seconds(budget_s)} budget",
            )
        now = time.monotonic()
        if now - self._last_unsure >= OWN_TIME_PROBE_S:
            self._last_unsure = now
            return None
        return Degraded(
            DegradedCode.TIMEOUT,
            f"the {_seconds(budget_s)} budget is shorter than these pairs' own "
            f"scoring time at the recent pace, about {_seconds(wait_s)} with "
            "nothing ahead: answered at once (one such request in "
            f"{OWN_TIME_PROBE_S:.0f} s is sent, to measure the pace again)",
        )

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
        resumption per result was the pipeline's largest fixed cost per candidate."""
        started = time.perf_counter()
        telemetry = self.telemetry
        request = self.resolve(query)

        with telemetry.step("rerank.shape") as span:
            shaped = shape(request)
            cap = request.max_candidates
            scored_set, tail = list(shaped.candidates[:cap]), list(shaped.candidates[cap:])
            skip = skip_reason(request, shaped)
            if span.is_recording():
                span.set_attributes(
                    _shape_attributes(request, shaped, 0 if skip else len(scored_set))
                )
        blend = self.blends.settle(
            request.blend,
            lambda: self.scorer.kind,
            lambda: self.scorer.model,
            lambda: dominant_script(request.query, (c.text for c in scored_set)),
        )
        # A profile is chosen by the model's name: until the backend has told it, the
        # pairs are sent (and the profile is chosen once their answers are in).
        if (
            skip is None
            and not request.always_score
            and (self.scorer.model or request.blend not in REQUEST_WIDE)
        ):
            skip = _no_reranker_weight(request, blend(), scored_set)
        ranking = IncrementalRanking(request.blend, scored_set, tail, lambda: blend().params)
        outcome = _Outcome(submitted=0 if skip else len(scored_set))

        if skip is not None:
            ranking.fail_outstanding()
            if released := Emitter(request.top_k).take(ranking.release()):
                yield released
            yield self._summary(request, shaped, blend(), ranking, outcome, skip, started)
            return

        with telemetry.step("rerank.chunk") as span:
            if chars_to_chunk(scored_set, request.max_chunk_chars) > CHUNK_ON_LOOP_CHARS:
                found = await _off_loop(
                    partial(document_texts, request.query, scored_set, request.max_chunk_chars),
                    _chunk_wait_s(request, deadline_remaining_s, started),
                )
                if found is None:  # the thread stayed busy with others' documents
                    documents, chunked = head_texts(scored_set, request.max_chunk_chars)
                    span.set_attribute("rerank.chunk_fallback", True)
                    log.info(
                        "chunking_busy",
                        fallback="document heads",
                        waited_ms=round((time.perf_counter() - started) * 1000, 1),
                    )
                else:
                    documents, chunked = found
            else:
                documents, chunked = document_texts(
                    request.query, scored_set, request.max_chunk_chars
                )
            span.set_attributes(
                {"rerank.max_chunk_chars": request.max_chunk_chars, "rerank.chunked": chunked}
            )
        emitter = Emitter(
            request.top_k,
            {c.index: d for c, d in zip(scored_set, documents, strict=True)}
            if request.return_text
            else None,
        )

        # Pairs the cache knows are resolved before anything is sent.
        scope = Scope(
            self.scorer.kind,
            self.scorer.model,
            request.instruction,
            request.query,
            request.max_tokens_per_doc,
            self.scorer.variant,
        )
        looked_up = await self.cache.lookup(scope, documents, bypass=request.bypass_cache)
        hits = looked_up.hits
        ranking.resolve_all((scored_set[i].index, score) for i, score in hits.items())
        emitter.mark_cached(scored_set[i].index for i in hits)
        outcome.cached = len(hits)
        if released := emitter.take(ranking.release()):
            yield released

        pending = [i for i in range(len(documents)) if i not in hits]
        fresh: dict[int, float] = {}  # position in `documents` -> score, for the cache
        scoring_started = time.perf_counter()
        # Counted from the request's arrival: chunking (a large request's, on the one
        # chunking thread, can wait behind another's) and the cache lookup took their part
        # of the deadline and of the timeout already. Not subtracted, a request that
        # spent 0.6 s before scoring answered 0.6 s after a 1 s deadline.
        elapsed = scoring_started - started
        budget = budget_s(
            request.timeout_s - elapsed,
            None if deadline_remaining_s is None else deadline_remaining_s - elapsed,
            self._loop_lag(),
            self.active,
        )
        overloaded = self._overloaded(len(pending), budget) if pending else None
        if overloaded is not None:
            ranking.fail_outstanding()  # answered at once, in retrieval order
            pending = []
            outcome.submitted = len(hits)  # what was not sent was not submitted
        if pending:
            pairs = ScoreRequest(
                request.query,
                request.instruction,
                [documents[i] for i in pending],
                request.max_tokens_per_doc,
            )
            left = len(pending)  # counted in `outstanding_pairs` until back
            self.outstanding_pairs += left
            try:
                async for arrived in score_within(
                    self.scorer, pairs, budget, telemetry.tracer, self.stopping, request_span
                ):
                    self.outstanding_pairs -= len(arrived)
                    left -= len(arrived)
                    resolved = []
                    for pair in arrived:
                        i = pending[pair.pair]
                        resolved.append((scored_set[i].index, pair.score))
                        if pair.failure is None and pair.score is not None:
                            fresh[i] = pair.score
                            outcome.scored += 1
                        else:
                            kind = pair.failure or Failure.MALFORMED
                            outcome.failures[kind] += 1
                            outcome.details.setdefault(kind, pair.detail)
                    ranking.resolve_all(resolved)
                    if released := emitter.take(ranking.release()):
                        yield released
            finally:
                self.outstanding_pairs -= left
        outcome.scoring_s = time.perf_counter() - scoring_started
        outcome.scored += len(hits)
        # Keyed by the model known now: a backend that names its model only in its answers
        # (llama-server without --model) would otherwise store under "". Not stored when
        # the variant changed meanwhile: `rerank` answers read as probabilities before the
        # switch to logits would land under the logits' key.
        if self.scorer.variant == scope.variant:
            model = self.scorer.model
            self.cache.store(
                looked_up,
                scope if model == scope.model else dataclasses.replace(scope, model=model),
                fresh,
            )

        # Results whose place was certain were blended and sent during scoring already.
        with telemetry.step("rerank.blend") as span:
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
        if final:
            yield final
        yield self._summary(
            request,
            shaped,
            settled,
            ranking,
            outcome,
            overloaded or outcome.degraded() or _capped(scored_set, tail),
            started,
        )

    def _summary(
        self,
        request: Request,
        shaped: Shaped,
        blend: Blend,
        ranking: IncrementalRanking,
        outcome: _Outcome,
        degraded: Degraded | None,
        started: float,
    ) -> RerankSummary:
        return RerankSummary(
            request_id=request.request_id,
            reranked=outcome.scored > 0,
            degraded=degraded,
            backend=self.scorer.kind,
            model=self.scorer.model,
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


# Up to 900 documents of 128 KiB to cut: seconds of Python at worst, which on the event
# loop would stall every other call and health check. In this thread the loop still gets
# the interpreter every switch interval. One thread: such jobs queue behind each other
# rather than contend, and leave the default executor (the disk cache's) alone.
_CHUNKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rerank-chunk")
# A request waits for the chunking thread at most this share of its time (timeout or
# deadline, whichever is shorter), counted from its arrival; the rest is for scoring.
# The thread searches about 7 MB of text a second here: a 16 MB request holds it for
# seconds, and a small request queued behind it answered after its deadline.
CHUNK_WAIT_SHARE = 0.5
MIN_CHUNK_WAIT_S = 0.05  # for an idle thread to take the job up


def _chunk_wait_s(request: Request, deadline_remaining_s: float | None, started: float) -> float:
    limit = (
        request.timeout_s
        if deadline_remaining_s is None
        else min(request.timeout_s, deadline_remaining_s)
    )
    return max(CHUNK_WAIT_SHARE * limit - (time.perf_counter() - started), MIN_CHUNK_WAIT_S)


async def _off_loop(job: Callable[[], T], wait_s: float) -> T | None:
    """`job` in the chunking thread; None when the thread has not taken it up within
    `wait_s` (it is then withdrawn). A job begun is waited for to its end, and so is one
    of a request cancelled meanwhile: the request's place and bytes stay counted while
    its texts are still being read, so cancelled requests cannot pile work up behind
    the budget."""
    begun = threading.Event()

    def run() -> T:
        begun.set()
        return job()

    submitted = _CHUNKER.submit(run)
    future = asyncio.wrap_future(submitted)
    try:
        await asyncio.wait({future}, timeout=wait_s)
        if not future.done() and not begun.is_set() and submitted.cancel():
            return None
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        if not submitted.cancel():  # withdrawn if not begun; else waited for
            await asyncio.wait({future})
        raise


class _Outcome:
    """How scoring went for one request: counts, failures by kind, time spent."""

    def __init__(self, submitted: int) -> None:
        self.submitted = submitted
        self.scored = 0
        self.cached = 0
        self.failures: Counter[Failure] = Counter()
        self.details: dict[Failure, str] = {}  # the first failure's detail, by kind
        self.scoring_s = 0.0

    def degraded(self) -> Degraded | None:
        failed = sum(self.failures.values())
        if failed == 0:
            return None
        # Details name exceptions, HTTP statuses and limits, never request text.
        kinds = ", ".join(
            f"{kind.value}: {n}" + (f", {self.details[kind]}" if self.details.get(kind) else "")
            for kind, n in self.failures.most_common()
        )
        if self.scored == 0:
            main = self.failures.most_common(1)[0][0]
            return Degraded(main.degraded_code, f"all {self.submitted} pairs failed ({kinds})")
        return Degraded(
            DegradedCode.PARTIAL, f"{failed} of {self.submitted} pairs failed ({kinds})"
        )


def _capped(scored: list[Candidate], tail: list[Candidate]) -> Degraded | None:
    """CAPPED when candidates beyond `max_candidates` were left unscored."""
    if not tail:
        return None
    return Degraded(
        DegradedCode.CAPPED,
        f"{len(tail)} of {len(scored) + len(tail)} candidates were not scored "
        f"(max_candidates={len(scored)}): they follow in retrieval order",
    )


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


# Admission keeps this share of a request's budget as slack for the estimate's error: the
# per-pair latency it works from is a moving average, and a loaded machine adds its own
# delays. Admitting up to the whole budget let admitted requests finish in its last few
# percent, so a slow moment ran some out of time (`tests/faults/test_overload.py`).
ADMISSION_HEADROOM = 0.1
# With nothing ahead, one request whose own pairs would outlast its budget is sent this
# often; the others are answered at once (`Reranker._overloaded`).
OWN_TIME_PROBE_S = 5.0


def _seconds(value: float) -> str:
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.1f} s"


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
