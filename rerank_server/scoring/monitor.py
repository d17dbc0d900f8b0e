"""Backend health: a `/health` poll, and a sanity probe each time the backend comes up.

The probe scores one clearly relevant and one clearly irrelevant pair. The monitor reports
what it finds through a callback, `report(component, up)`, and knows nothing of who
listens (the gRPC edge turns it into health service names, `api/health.py`):

- `BACKEND` (""): up while the backend answers and yields scores.
- `HOST:PORT`: one per instance, up while its `/health` answers 200.
- `DISCRIMINATES`: up when the probe's relevant pair scored clearly above the irrelevant
  one. A model that cannot tell them apart, or gives degenerate scores (a GGUF without its
  classification head gives values like 1e-28), is down here and logged as a warning.

Each poll also returns ejected instances whose back-off is over and whose `/health`
answers (`scoring/pool.py`). State changes are logged once per change, not per poll.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog

from ..observability.metrics import Metrics
from .backend_pool import BackendPool, Endpoint
from .base import PairOutcome, Scorer, ScoreRequest

log = structlog.get_logger(__name__)

PROBE_QUERY = "What is the capital of France?"
PROBE_RELEVANT = "Paris is the capital and most populous city of France."
PROBE_IRRELEVANT = ("Photosynthesis lets green plants turn sunlight, water and carbon dioxide "
                    "into sugar.")
MIN_SEPARATION = 0.05
DEGENERATE_BELOW = 1e-6

BACKEND = ""
DISCRIMINATES = "discriminates"

Report = Callable[[str, bool], Awaitable[None]]
"""`report(component, up)`: `BACKEND`, `DISCRIMINATES`, or an instance's `HOST:PORT`."""


@dataclass(frozen=True, slots=True)
class ProbeResult:
    relevant: float | None
    irrelevant: float | None

    @property
    def scored(self) -> bool:
        return self.relevant is not None and self.irrelevant is not None

    @property
    def degenerate(self) -> bool:
        if self.relevant is None or self.irrelevant is None:
            return False
        return max(self.relevant, self.irrelevant) < DEGENERATE_BELOW or \
            min(self.relevant, self.irrelevant) > 1 - DEGENERATE_BELOW

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

    def __init__(self, scorer: Scorer, pool: BackendPool, instruction: str, report: Report,
                 interval_s: float = 5.0, run_probe: bool = True,
                 metrics: Metrics | None = None) -> None:
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

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(self._interval_s)

    async def check(self) -> None:
        await asyncio.gather(*(self._check_instance(e) for e in self._pool.endpoints))
        up = self._pool.any_available
        if up == self._up:
            return
        self._up = up
        if not up:
            log.warning("backend_down", backend=self._scorer.kind)
            await self._set(backend=False, discriminates=False)
            return
        await self._scorer.discover_model()
        log.info("backend_up", backend=self._scorer.kind, model=self._scorer.model)
        self.ready.set()
        if not self._run_probe:
            await self._set(backend=True, discriminates=True)
            return
        result = await probe(self._scorer, self._instruction)
        self.last_probe = result
        self._report(result)
        await self._set(backend=result.scored, discriminates=result.discriminates)
        self.probed.set()

    async def _check_instance(self, endpoint: Endpoint) -> None:
        polled = await endpoint.http.health()
        up = self._pool.note_poll(endpoint, polled)
        self._metrics.backend_up.set(int(up), endpoint.http.instance.attributes)
        endpoint.healthy = up
        if endpoint in self._pool.due_for_probe():
            if polled:
                self._pool.restore(endpoint)
            else:
                self._pool.extend(endpoint)
        if self._instance_up.get(endpoint.name) == up:
            return
        self._instance_up[endpoint.name] = up
        if up:
            log.info("backend_instance_up", instance=endpoint.name)
        else:
            log.warning("backend_instance_down", instance=endpoint.name)
        await self._report_state(endpoint.name, up)

    def _report(self, r: ProbeResult) -> None:
        fields = {"relevant": r.relevant, "irrelevant": r.irrelevant,
                  "backend": self._scorer.kind, "model": self._scorer.model}
        if not r.scored:
            log.warning("backend_probe_unscored", **fields)
        elif r.degenerate:
            log.warning("backend_probe_degenerate", hint="scores near 0 or 1 for both pairs: "
                        "a GGUF without its classification head?", **fields)
        elif not r.discriminates:
            log.warning("backend_probe_indistinct", hint="the model cannot tell a relevant "
                        "from an irrelevant passage; its reranking adds noise", **fields)
        else:
            log.info("backend_probe_ok", **fields)

    async def _set(self, *, backend: bool, discriminates: bool) -> None:
        await self._report_state(BACKEND, backend)
        await self._report_state(DISCRIMINATES, discriminates)
