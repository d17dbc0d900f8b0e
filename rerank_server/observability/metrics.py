"""Every metric the server records, defined in one place (docs/observability.md lists them).

Attributes never hold query or document text; their values are small closed sets.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from opentelemetry.metrics import (
    CallbackOptions,
    MeterProvider,
    NoOpMeterProvider,
    Observation,
)
from prometheus_client import CollectorRegistry

from .. import __version__
from ..domain import RerankSummary
from .instruments import SCOPE_NAME, Instruments, bound

# 5 ms .. 15 s: a cached answer takes a few milliseconds, a large batch on a CPU model
# takes seconds.
DURATION_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0)
# Retrieval hands over 5..100 candidates in practice; the last buckets catch large caps.
# Floats, so both paths write `le="5.0"` (OpenTelemetry's exporter writes an int as "5",
# prometheus_client as "5.0"; Prometheus reads both as the same number).
COUNT_BUCKETS = (5.0, 10.0, 20.0, 30.0, 50.0, 75.0, 100.0, 250.0, 1000.0)

# Attribute keys (semantic conventions where they exist).
RPC_SYSTEM_NAME = "rpc.system.name"
RPC_METHOD = "rpc.method"
RPC_STATUS = "rpc.response.status_code"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
HTTP_METHOD = "http.request.method"
HTTP_STATUS = "http.response.status_code"
ERROR_TYPE = "error.type"
BACKEND = "rerank.backend"
MODEL = "rerank.model"  # the served model (`--model NAME=SOURCE`), or the backend's name
REASON = "rerank.degraded_reason"
RERANKED = "rerank.reranked"
PAIR_OUTCOME = "rerank.pair.outcome"
CACHE_RESULT = "rerank.cache.result"
TOKEN = "rerank.token"  # a bearer token's name (docs/security.md), never the token
LIMIT = "rerank.limit"  # rps, pairs_per_minute or concurrent
CACHE_TIER = "rerank.cache.tier"  # where a hit came from: memory, shared, disk
THRESHOLD_BUCKETS = (0.35, 0.4, 0.45, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 1.0)
BLEND = "rerank.blend"
BLEND_PROFILE = "rerank.blend_profile"
# 0 exactly (the retrieval order) gets its own bucket: "the reranker was ignored".
WEIGHT_BUCKETS = (0.0, 0.25, 0.5, 0.75, 0.999, 1.0)


@dataclass(frozen=True, slots=True)
class Instance:
    """Who a backend call went to, as metric and span attributes."""

    backend: str
    address: str
    port: int

    @property
    def attributes(self) -> dict[str, str | int]:
        return {BACKEND: self.backend, SERVER_ADDRESS: self.address, SERVER_PORT: self.port}


INSTANCE_KEYS = (BACKEND, SERVER_ADDRESS, SERVER_PORT)

# Counted by the process that runs llama-server: the server, or with `--workers` the
# supervisor (`worker_metrics.SupervisorMetrics`), under the same name either way.
LLAMA_RESTARTS = (
    "rerank.llama_server.restarts",
    "{restart}",
    "Restarts of the managed llama-server after it exited.",
)


class CallDurations:
    """`http.client.request.duration`: one sample per backend call, 40 per `chat` request.

    Keyed by (instance, status, error type) to a record with those attributes fixed
    (`instruments.bound`): with the direct histogram, a dict lookup and an observe.
    """

    DESCRIPTION = "Duration of HTTP calls to scoring backends, by instance and outcome."

    def __init__(self, instruments: Instruments) -> None:
        self._histogram = instruments.histogram(
            "http.client.request.duration",
            "s",
            self.DESCRIPTION,
            DURATION_BUCKETS_S,
            keys=(*INSTANCE_KEYS, HTTP_METHOD, HTTP_STATUS, ERROR_TYPE),
        )
        self._records: dict[tuple[Instance, int | None, str | None], Callable[[float], None]] = {}

    def record(
        self, seconds: float, instance: Instance, status: int | None, error_type: str | None
    ) -> None:
        """One POST to `instance`: its HTTP status when it answered, its error type when
        it failed."""
        key = (instance, status, error_type)
        record = self._records.get(key)
        if record is None:
            attributes: dict[str, str | int] = {**instance.attributes, HTTP_METHOD: "POST"}
            if status is not None:
                attributes[HTTP_STATUS] = status
            if error_type is not None:
                attributes[ERROR_TYPE] = error_type
            record = self._records[key] = bound(self._histogram, attributes)
        record(seconds)


class Metrics:
    """The server's instruments and the few helpers that record them consistently.

    `prometheus`: the registry the Prometheus endpoint serves, when metrics go only there;
    the instruments then record straight into it (`instruments.py`). With metrics off the
    meter is the no-op provider's, and a record costs a method call.
    """

    def __init__(
        self, provider: MeterProvider, prometheus: CollectorRegistry | None = None
    ) -> None:
        meter = provider.get_meter(SCOPE_NAME, __version__)
        make = Instruments(meter, prometheus)
        # --- RPCs
        self.rpc_duration = make.histogram(
            "rpc.server.call.duration",
            "s",
            "Duration of gRPC calls handled, by method and status code.",
            DURATION_BUCKETS_S,
            keys=(RPC_SYSTEM_NAME, RPC_METHOD, RPC_STATUS),
        )
        self.rpc_active = make.up_down_counter(
            "rerank.server.active_rpcs",
            "{rpc}",
            "Rerank requests in progress, gRPC calls and JSON rerank requests by method "
            "or route (health, reflection and /v1/models excluded).",
            keys=(RPC_METHOD,),
        )
        self.rpc_rejected = make.counter(
            "rerank.server.rejected_rpcs",
            "{rpc}",
            "Reranker RPCs and JSON rerank requests refused (RESOURCE_EXHAUSTED, 429) "
            "because max_concurrent_rpcs were already in progress.",
            keys=(RPC_METHOD,),
        )
        self.limit_refusals = make.counter(
            "rerank.limit.refusals",
            "{request}",
            "Requests refused (RESOURCE_EXHAUSTED, 429) because their token was over one "
            "of its limits, by token name and limit; both edges.",
            keys=(TOKEN, LIMIT),
        )
        self.limit_counter_errors = make.counter(
            "rerank.limit.counter_errors",
            "{call}",
            "Calls to the limit counter shared in --cache-url that failed or were not "
            "sent, by rerank.limit and error.type (timeout, connection, refused, busy, "
            "down): the request went on as if under its limit; a place not given back "
            "is held until its lease ends.",
            keys=(LIMIT, ERROR_TYPE),
        )
        # --- rerank requests (one per Rerank/RerankStream call and per RerankBatch item)
        self.requests = make.counter(
            "rerank.requests",
            "{request}",
            "Rerank requests answered, by whether they were reranked and why not.",
            keys=(RERANKED, REASON, BACKEND, MODEL),
        )
        self.candidates = make.histogram(
            "rerank.request.candidates",
            "{candidate}",
            "Candidates per rerank request, as received.",
            COUNT_BUCKETS,
        )
        self.pairs_scored = make.histogram(
            "rerank.request.scored_pairs",
            "{pair}",
            "Pairs the scorer scored per rerank request.",
            COUNT_BUCKETS,
        )
        self.pairs = make.counter(
            "rerank.pairs",
            "{pair}",
            "Query-document pairs by outcome: scored (by the backend), cached (from the "
            "score cache), failed (error.type says how).",
            keys=(PAIR_OUTCOME, BACKEND, MODEL, ERROR_TYPE),
        )
        self.duration = make.histogram(
            "rerank.request.duration",
            "s",
            "Time from a request's arrival in the pipeline to its summary.",
            DURATION_BUCKETS_S,
        )
        self.scoring_duration = make.histogram(
            "rerank.scoring.duration",
            "s",
            "Time spent waiting for the scorer per rerank request.",
            DURATION_BUCKETS_S,
        )
        self.cache_lookups = make.counter(
            "rerank.cache.lookups",
            "{pair}",
            "Score cache lookups by rerank.cache.result: hit (rerank.cache.tier: memory, "
            "shared, disk), miss, or bypass (the request asked not to read the cache).",
            keys=(CACHE_RESULT, CACHE_TIER),
        )
        self.cache_shared_duration = make.histogram(
            "rerank.cache.shared.duration",
            "s",
            "Reads of the shared score cache (--cache-url), one per request that missed "
            "memory, with error.type when it failed: timeout (past --cache-timeout-ms), "
            "connection, refused, busy (not sent: too many in flight).",
            (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
            keys=(ERROR_TYPE,),
        )
        self.threshold = make.histogram(
            "rerank.threshold.final",
            "1",
            "The threshold finally applied, per request that asked for one.",
            THRESHOLD_BUCKETS,
        )
        self.reranker_weight = make.histogram(
            "rerank.blend.reranker_weight",
            "1",
            "The reranker's weight in a request-wide blend (adaptive, profile): 0 keeps "
            "the retrieval order, 1 is the reranker's order.",
            WEIGHT_BUCKETS,
            keys=(BACKEND, BLEND, BLEND_PROFILE),
        )
        self.threshold_steps = make.histogram(
            "rerank.threshold.steps",
            "{step}",
            "How many times the adaptive threshold was lowered per request.",
            (0.0, 1.0, 2.0, 4.0, 8.0),
        )
        # --- backend instances
        self.call_durations = CallDurations(make)
        # Read when scraped, from each instance's own count (`watch_active`): counting
        # up and down through the SDK on every call costs more than the call's own
        # bookkeeping. Observed, so it
        # stays with the SDK even when the others record directly.
        self._active: dict[int, Callable[[], tuple[int, dict[str, str | int]]]] = {}
        meter.create_observable_up_down_counter(
            "http.client.active_requests",
            callbacks=[self._observe_active],
            unit="{request}",
            description="HTTP calls to a scoring backend instance in flight.",
        )
        self.backend_errors = make.counter(
            "rerank.backend.errors",
            "{error}",
            "Failed backend calls by instance and error.type: timeout, connect, "
            "http_status, malformed.",
            keys=(*INSTANCE_KEYS, ERROR_TYPE),
        )
        self.abandoned_calls = make.counter(
            "rerank.backend.abandoned_calls",
            "{call}",
            "Backend calls whose request stopped waiting for them (budget spent, client "
            "gone); each still holds its slot until it ends.",
            keys=INSTANCE_KEYS,
        )
        self.abandoned_open = make.up_down_counter(
            "rerank.backend.abandoned_calls.open",
            "{call}",
            "Abandoned backend calls still running.",
            keys=INSTANCE_KEYS,
        )
        self.abandoned_age = make.histogram(
            "rerank.backend.abandoned_call.age",
            "s",
            "How long an abandoned call ran on after it was abandoned (answered, or "
            "cancelled when its leash ran out).",
            DURATION_BUCKETS_S,
            keys=INSTANCE_KEYS,
        )
        self.backend_ejections = make.counter(
            "rerank.backend.ejections",
            "{ejection}",
            "Times an instance was taken out of the pool after failing calls in a row.",
            keys=INSTANCE_KEYS,
        )
        self.backend_up = make.gauge(
            "rerank.backend.up",
            "1",
            "1 while the backend's /health answers 200, else 0.",
            keys=INSTANCE_KEYS,
        )
        self.llama_restarts = make.counter(*LLAMA_RESTARTS)

    def watch_active(
        self, owner: object, source: Callable[[], tuple[int, dict[str, str | int]]] | None
    ) -> None:
        """Report `source()` (calls in flight, instance attributes) as the owner's
        `http.client.active_requests` from now on; None stops it."""
        if source is None:
            self._active.pop(id(owner), None)
        else:
            self._active[id(owner)] = source

    def _observe_active(self, _options: CallbackOptions) -> Iterable[Observation]:
        for source in list(self._active.values()):
            count, attributes = source()
            yield Observation(count, attributes)

    @classmethod
    def noop(cls) -> Metrics:
        return cls(NoOpMeterProvider())

    def record_rerank(self, summary: RerankSummary) -> None:
        """Everything one answered rerank request contributes."""
        reason = summary.degraded.code.value if summary.degraded else "none"
        self.requests.add(
            1,
            {
                RERANKED: summary.reranked,
                REASON: reason,
                BACKEND: summary.backend,
                MODEL: summary.model,
            },
        )
        self.candidates.record(summary.candidates)
        self.pairs_scored.record(summary.scored)
        if summary.scored - summary.cached:
            self.pairs.add(
                summary.scored - summary.cached,
                {PAIR_OUTCOME: "scored", BACKEND: summary.backend, MODEL: summary.model},
            )
        if summary.cached:
            self.pairs.add(
                summary.cached,
                {PAIR_OUTCOME: "cached", BACKEND: summary.backend, MODEL: summary.model},
            )
        if summary.threshold is not None:
            self.threshold.record(summary.threshold.threshold)
            self.threshold_steps.record(summary.threshold.steps)
        for failure, n in summary.failures.items():
            self.pairs.add(
                n,
                {
                    PAIR_OUTCOME: "failed",
                    ERROR_TYPE: failure,
                    BACKEND: summary.backend,
                    MODEL: summary.model,
                },
            )
        if summary.reranker_weight is not None:
            self.reranker_weight.record(
                summary.reranker_weight,
                {
                    BACKEND: summary.backend,
                    BLEND: summary.blend.value,
                    BLEND_PROFILE: summary.blend_profile,
                },
            )
        self.duration.record(summary.total_ms / 1000)
        if summary.submitted:
            self.scoring_duration.record(summary.scoring_ms / 1000)
