"""Backend health: a `/health` poll, and a sanity probe each time the backend comes up.

Reported through a callback, `report(component, up)`; docs/architecture.md has the names.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog

from ..observability.metrics import Metrics
from .base import Failure, PairOutcome, Scorer, ScoreRequest
from .transport.pool import BackendPool, Endpoint

log = structlog.get_logger(__name__)

PROBE_QUERY = "What is the capital of France?"
PROBE_RELEVANT = "Paris is the capital and most populous city of France."
PROBE_IRRELEVANT = (
    "Photosynthesis lets green plants turn sunlight, water and carbon dioxide into sugar."
)
MIN_SEPARATION = 0.05
INSTANCE_PROBE_TIMEOUT_S = 5.0
MIN_WAIT_S = 0.05  # the monitor's shortest sleep between looks at the pool
DEGENERATE_BELOW = 1e-6
REPROBE_S = 5.0  # a probe that did not score is tried again after this, doubling,
REPROBE_MAX_S = 60.0  # to at most this, while the backend stays up

BACKEND = ""
DISCRIMINATES = "discriminates"

Report = Callable[[str, bool], Awaitable[None]]
"""`report(component, up)`: `BACKEND` (up while the backend answers and yields scores),
`DISCRIMINATES` (while the probe's relevant pair scores clearly above the irrelevant one,
the scores not degenerate), or an instance's `HOST:PORT` (while its `/health` answers 200)."""


def _probe_window_s(endpoint: Endpoint) -> float:
    """How long a re-admission probe waits. A slow model is not a dead one: as long as a
    real call would be given (the abandon leash: 4x its recent latency, at most the call
    timeout), so an instance whose calls take longer than 5 s can still come back. And
    twice that for each probe that failed in a row, up to the call timeout: the latency
    is what answered calls showed, and an instance that slowed down (every call since
    abandoned, none answered to say so) never fitted in a window sized by its old pace."""
    window = max(INSTANCE_PROBE_TIMEOUT_S, endpoint.http.leash_s())
    doubled = window * 2.0 ** min(max(endpoint.ejections_in_row - 1, 0), 16)
    return min(doubled, max(window, endpoint.http.timeout_s))


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """The sanity probe's scores of its relevant and irrelevant pair; None where unscored."""

    relevant: float | None
    irrelevant: float | None

    @property
    def scored(self) -> bool:
        return self.relevant is not None and self.irrelevant is not None

    @property
    def degenerate(self) -> bool:
        if self.relevant is None or self.irrelevant is None:
            return False
        return (
            max(self.relevant, self.irrelevant) < DEGENERATE_BELOW
            or min(self.relevant, self.irrelevant) > 1 - DEGENERATE_BELOW
        )

    @property
    def discriminates(self) -> bool:
        if self.relevant is None or self.irrelevant is None or self.degenerate:
            return False
        return self.relevant - self.irrelevant >= MIN_SEPARATION


async def probe(scorer: Scorer, instruction: str, timeout_s: float = 30.0) -> ProbeResult:
    scores: dict[int, float | None] = {0: None, 1: None}

    def emit(outcome: PairOutcome) -> None:
        scores[outcome.pair] = outcome.score

    request = ScoreRequest(PROBE_QUERY, instruction, [PROBE_RELEVANT, PROBE_IRRELEVANT])
    try:
        async with asyncio.timeout(timeout_s):
            await scorer.score(request, emit)
    except TimeoutError:
        pass
    return ProbeResult(scores[0], scores[1])


class BackendMonitor:
    """Polls every instance's `/health`, returns ejected instances, probes the backend.

    The backend as a whole is up while at least one instance is available; each time it
    comes up from down, the model's name is asked for and the probe runs.
    """

    def __init__(
        self,
        scorer: Scorer,
        pool: BackendPool,
        instruction: str,
        report: Report,
        interval_s: float = 5.0,
        run_probe: bool = True,
        metrics: Metrics | None = None,
    ) -> None:
        self._scorer = scorer
        self._pool = pool
        self._instruction = instruction
        self._report_state = report
        self._interval_s = interval_s
        self._run_probe = run_probe
        self._metrics = metrics or Metrics.noop()
        self._up: bool | None = None
        self._instance_up: dict[str, bool] = {}
        self.last_probe: ProbeResult | None = None
        self.probed = asyncio.Event()
        # Set once the backend was first seen up and its model name asked for.
        self.ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._probes: dict[str, asyncio.Task[None]] = {}  # instance name -> its probe
        self._came_up: asyncio.Task[None] | None = None
        self._reprobe: asyncio.Task[None] | None = None  # while the probe has not scored

    @property
    def backend_up(self) -> bool | None:
        """Whether the backend can score: None until the first check."""
        return self._up

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        tasks = [
            t
            for t in (self._task, self._came_up, self._reprobe, *self._probes.values())
            if t is not None
        ]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        next_poll = loop.time()
        while True:
            try:
                if loop.time() >= next_poll:
                    next_poll = loop.time() + self._interval_s
                    await self._check()
                else:
                    await self.tick()
            except Exception:  # a bug here must not end health reporting for good
                log.exception("backend_monitor_error")
            await self._until_due(next_poll)

    async def _until_due(self, next_poll: float) -> None:
        """Sleep until the next poll, the next back-off's end among instances not being
        probed (a probe's end restores or ejects again, which changes the pool), or a
        change in the pool, whichever is first."""
        loop = asyncio.get_running_loop()
        wake = next_poll
        probe_in = self._pool.next_probe_in(skip=self._probes.keys())
        if probe_in is not None:
            wake = min(wake, loop.time() + probe_in)
        # Not sooner than MIN_WAIT_S: the pool's clock and uvloop's cached, millisecond
        # loop time disagree by a hair (a wake-up a hair early would find nothing due
        # and go round again), and a back-off or poll interval set near zero must not
        # make probes and polls run back to back.
        wake = max(wake, loop.time() + MIN_WAIT_S)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout_at(wake):
                await self._pool.changed.wait()
        self._pool.changed.clear()

    async def check(self) -> None:
        """Poll every instance's `/health`, then `tick`, and wait for what a backend that
        came up sets off (its model's name, the probe)."""
        await self._check()
        if self._came_up is not None:  # cancelled if the backend went down meanwhile
            await asyncio.gather(self._came_up, return_exceptions=True)

    async def _check(self) -> None:
        await asyncio.gather(*(self._poll(e) for e in self._pool.endpoints))
        await self.tick()

    async def tick(self) -> None:
        """Probe ejected instances that are due; report state that changed."""
        for endpoint in self._pool.due_for_probe():
            if endpoint.name not in self._probes:
                self._probes[endpoint.name] = asyncio.create_task(self._probe_instance(endpoint))
        for endpoint in self._pool.endpoints:
            await self._report_instance(endpoint)
        up = self._pool.any_available
        if up == self._up:
            return
        self._up = up
        # What the last coming up set off is stale either way: a probe finishing after the
        # backend went down would report it SERVING.
        for task in (self._came_up, self._reprobe):
            if task is not None:
                task.cancel()
        self._reprobe = None
        if not up:
            log.warning("backend_down", backend=self._scorer.kind)
            await self._set(backend=False, discriminates=False)
            return
        # The model's name and the probe can take long (a slow model): in a task of their
        # own, so ticks go on probing ejected instances and reporting meanwhile.
        self._came_up = asyncio.create_task(self._on_up())

    async def _on_up(self) -> None:
        await self._scorer.discover_model()
        log.info("backend_up", backend=self._scorer.kind, model=self._scorer.model)
        self.ready.set()
        if not self._run_probe:
            await self._set(backend=True, discriminates=True)
            return
        if not await self._probe_and_set():
            self._reprobe = asyncio.create_task(self._probe_until_scored())

    async def _probe_and_set(self) -> bool:
        """The sanity probe, reported; whether it scored."""
        result = await probe(self._scorer, self._instruction)
        self.last_probe = result
        self._report(result)
        await self._set(backend=result.scored, discriminates=result.discriminates)
        self.probed.set()
        return result.scored

    async def _probe_until_scored(self) -> None:
        """The probe again, less often each time, until it scores or the backend goes
        down: one that failed (a hiccup as the backend came up) held `backend`
        NOT_SERVING for as long as the pool stayed up, while requests reranked."""
        wait_s = REPROBE_S
        while True:
            await asyncio.sleep(wait_s)
            if await self._probe_and_set():
                return
            wait_s = min(wait_s * 2, REPROBE_MAX_S)

    async def _poll(self, endpoint: Endpoint) -> None:
        polled = await endpoint.http.health()
        up = self._pool.note_poll(endpoint, polled)
        self._metrics.backend_up.set(int(up), endpoint.http.instance.attributes)
        endpoint.healthy = up

    async def _probe_instance(self, endpoint: Endpoint) -> None:
        """One scoring call to an ejected instance: restore it if it answers."""
        outcomes: list[PairOutcome] = []
        request = ScoreRequest(PROBE_QUERY, self._instruction, [PROBE_RELEVANT])
        try:
            with self._pool.pinned(endpoint):
                async with asyncio.timeout(_probe_window_s(endpoint)):
                    await self._scorer.score(request, outcomes.append)
        except TimeoutError:
            pass
        finally:
            self._probes.pop(endpoint.name, None)
            # Wake the monitor whatever happened: it skipped this instance's back-off
            # while the probe ran (a probe that raised neither restores nor ejects).
            self._pool.changed.set()
        # A malformed answer is still an answer: the instance is alive and scoring.
        if any(o.failure in (None, Failure.MALFORMED) for o in outcomes):
            self._pool.restore(endpoint)
        else:
            self._pool.extend(endpoint)
        await self._report_instance(endpoint)

    async def _report_instance(self, endpoint: Endpoint) -> None:
        up = endpoint.available
        if self._instance_up.get(endpoint.name) == up:
            return
        self._instance_up[endpoint.name] = up
        if up:
            log.info("backend_instance_up", instance=endpoint.name)
        else:
            log.warning("backend_instance_down", instance=endpoint.name)
        await self._report_state(endpoint.name, up)

    def _report(self, r: ProbeResult) -> None:
        fields = {
            "relevant": r.relevant,
            "irrelevant": r.irrelevant,
            "backend": self._scorer.kind,
            "model": self._scorer.model,
        }
        if not r.scored:
            log.warning("backend_probe_unscored", **fields)
        elif r.degenerate:
            log.warning(
                "backend_probe_degenerate",
                hint="scores near 0 or 1 for both pairs: a GGUF without its classification head?",
                **fields,
            )
        elif not r.discriminates:
            log.warning(
                "backend_probe_indistinct",
                hint="the model cannot tell a relevant "
                "from an irrelevant passage; its reranking adds noise",
                **fields,
            )
        else:
            log.info("backend_probe_ok", **fields)

    async def _set(self, *, backend: bool, discriminates: bool) -> None:
        await self._report_state(BACKEND, backend)
        await self._report_state(DISCRIMINATES, discriminates)
