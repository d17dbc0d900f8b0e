"""Every metric the server records, defined in one place (docs/observability.md lists them).

Names follow the OpenTelemetry semantic conventions where one exists (`rpc.server.*`,
`http.client.*`) and carry a `rerank.` prefix otherwise. Units are declared, so the
Prometheus exporter appends `_seconds`, `_total` and so on.

The instruments come from whatever `MeterProvider` the server was given: with metrics off
that is the no-op provider and each record call costs a method call and nothing more.
One instrument is recorded per backend call rather than per request, so it has a cheaper
path (`CallDurations`).
Attributes never hold query or document text; their values are small closed sets (method
names, status codes, reason codes, backend instances from the configuration).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import prometheus_client
from opentelemetry.metrics import (
    CallbackOptions,
    Histogram,
    Meter,
    MeterProvider,
    NoOpMeterProvider,
    Observation,
)
from prometheus_client import CollectorRegistry

from .. import __version__
from ..domain import RerankSummary

# 5 ms .. 15 s: a cached answer takes a few milliseconds, a large batch on a CPU model
# takes seconds.
DURATION_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0)
# Retrieval hands over 5..100 candidates in practice; the last buckets catch large caps.
COUNT_BUCKETS = (5, 10, 20, 30, 50, 75, 100, 250, 1000)

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
REASON = "rerank.degraded_reason"
RERANKED = "rerank.reranked"
PAIR_OUTCOME = "rerank.pair.outcome"
CACHE_RESULT = "rerank.cache.result"
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


class CallDurations:
    """`http.client.request.duration`: one sample per backend call, 40 per `chat` request.

    Through OpenTelemetry's SDK a record with these five attributes costs about 8 µs (it
    cleans and hashes the attributes on every call), which was most of what metrics cost
    a `chat` request. When metrics go only to the Prometheus endpoint (the default), the
    samples go straight into a prometheus_client histogram in the endpoint's registry,
    about 1 µs, under the name, labels and buckets OpenTelemetry's exporter gives them
    (tests/unit/test_metrics.py holds the two renderings equal). With OTLP metrics on,
    the OpenTelemetry instrument records them, so both exports carry them.
    """

    # The labels OpenTelemetry's Prometheus exporter gives this family: every attribute
    # key (empty where a sample has none; the exporter leaves out a key no sample has,
    # which Prometheus treats the same) and the instrumentation scope.
    LABELS = ("rerank_backend", "server_address", "server_port", "http_request_method",
              "http_response_status_code", "error_type", "otel_scope_name",
              "otel_scope_schema_url", "otel_scope_version")

    DESCRIPTION = "Duration of HTTP calls to scoring backends, by instance and outcome."

    def __init__(self, meter: Meter, registry: CollectorRegistry | None) -> None:
        self._instrument: Histogram | None = None
        self._histogram: prometheus_client.Histogram | None = None
        # (instance, status, error type) -> the labelled child: a record is then a dict
        # lookup and an observe.
        self._children: dict[tuple[Instance, int | None, str | None],
                             prometheus_client.Histogram] = {}
        if registry is None:
            self._instrument = meter.create_histogram(
                "http.client.request.duration", unit="s", description=self.DESCRIPTION,
                explicit_bucket_boundaries_advisory=DURATION_BUCKETS_S)
            return
        # No `_created` series, as OpenTelemetry's exporter has none; nothing else in the
        # process uses prometheus_client's own metrics.
        prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
        self._histogram = prometheus_client.Histogram(
            "http_client_request_duration_seconds", self.DESCRIPTION, self.LABELS,
            registry=registry, buckets=DURATION_BUCKETS_S)

    def record(self, seconds: float, instance: Instance, status: int | None,
               error_type: str | None) -> None:
        """One POST to `instance`: its HTTP status when it answered, its error type when
        it failed."""
        if self._instrument is not None:
            attributes: dict[str, str | int] = {**instance.attributes, HTTP_METHOD: "POST"}
            if status is not None:
                attributes[HTTP_STATUS] = status
            if error_type is not None:
                attributes[ERROR_TYPE] = error_type
            self._instrument.record(seconds, attributes)
            return
        key = (instance, status, error_type)
        child = self._children.get(key)
        if child is None:
            assert self._histogram is not None
            child = self._children[key] = self._histogram.labels(
                instance.backend, instance.address, str(instance.port), "POST",
                "" if status is None else str(status), error_type or "", "rerank_server",
                "", __version__)
        child.observe(seconds)


class Metrics:
    """The server's instruments and the few helpers that record them consistently.

    `prometheus`: the registry the Prometheus endpoint serves, when metrics go only there
    (`CallDurations` then records into it directly).
    """

    def __init__(self, provider: MeterProvider,
                 prometheus: CollectorRegistry | None = None) -> None:
        meter = provider.get_meter("rerank_server", __version__)
        # --- RPCs
        self.rpc_duration = meter.create_histogram(
            "rpc.server.call.duration", unit="s",
            description="Duration of gRPC calls handled, by method and status code.",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS_S)
        self.rpc_active = meter.create_up_down_counter(
            "rerank.server.active_rpcs", unit="{rpc}",
            description="Reranker RPCs in progress (health and reflection excluded).")
        self.rpc_rejected = meter.create_counter(
            "rerank.server.rejected_rpcs", unit="{rpc}",
            description="Reranker RPCs refused with RESOURCE_EXHAUSTED because "
                        "max_concurrent_rpcs were already in progress.")
        # --- rerank requests (one per Rerank/RerankStream call and per RerankBatch item)
        self.requests = meter.create_counter(
            "rerank.requests", unit="{request}",
            description="Rerank requests answered, by whether they were reranked and why not.")
        self.candidates = meter.create_histogram(
            "rerank.request.candidates", unit="{candidate}",
            description="Candidates per rerank request, as received.",
            explicit_bucket_boundaries_advisory=COUNT_BUCKETS)
        self.pairs_scored = meter.create_histogram(
            "rerank.request.scored_pairs", unit="{pair}",
            description="Pairs the scorer scored per rerank request.",
            explicit_bucket_boundaries_advisory=COUNT_BUCKETS)
        self.pairs = meter.create_counter(
            "rerank.pairs", unit="{pair}",
            description="Query-document pairs by outcome: scored (by the backend), cached "
                        "(from the score cache), failed (error.type says how).")
        self.duration = meter.create_histogram(
            "rerank.request.duration", unit="s",
            description="Time from a request's arrival in the pipeline to its summary.",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS_S)
        self.scoring_duration = meter.create_histogram(
            "rerank.scoring.duration", unit="s",
            description="Time spent waiting for the scorer per rerank request.",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS_S)
        self.cache_lookups = meter.create_counter(
            "rerank.cache.lookups", unit="{pair}",
            description="Score cache lookups by rerank.cache.result: hit, miss, or bypass "
                        "(the request asked not to read the cache).")
        self.threshold = meter.create_histogram(
            "rerank.threshold.final", unit="1",
            description="The threshold finally applied, per request that asked for one.",
            explicit_bucket_boundaries_advisory=THRESHOLD_BUCKETS)
        self.reranker_weight = meter.create_histogram(
            "rerank.blend.reranker_weight", unit="1",
            description="The reranker's weight in a request-wide blend (adaptive, profile): "
                        "0 keeps the retrieval order, 1 is the reranker's order.",
            explicit_bucket_boundaries_advisory=WEIGHT_BUCKETS)
        self.threshold_steps = meter.create_histogram(
            "rerank.threshold.steps", unit="{step}",
            description="How many times the adaptive threshold was lowered per request.",
            explicit_bucket_boundaries_advisory=(0, 1, 2, 4, 8))
        # --- backend instances
        self.call_durations = CallDurations(meter, prometheus)
        # Read when scraped, from each instance's own count (`watch_active`): counting
        # up and down on every call cost about 13 µs of CPU per call.
        self._active: dict[int, Callable[[], tuple[int, dict[str, str | int]]]] = {}
        meter.create_observable_up_down_counter(
            "http.client.active_requests", callbacks=[self._observe_active],
            unit="{request}",
            description="HTTP calls to a scoring backend instance in flight.")
        self.backend_errors = meter.create_counter(
            "rerank.backend.errors", unit="{error}",
            description="Failed backend calls by instance and error.type: timeout, connect, "
                        "http_status, malformed.")
        self.abandoned_calls = meter.create_counter(
            "rerank.backend.abandoned_calls", unit="{call}",
            description="Backend calls whose request stopped waiting for them (budget spent, "
                        "client gone); each still holds its slot until it ends.")
        self.abandoned_open = meter.create_up_down_counter(
            "rerank.backend.abandoned_calls.open", unit="{call}",
            description="Abandoned backend calls still running.")
        self.abandoned_age = meter.create_histogram(
            "rerank.backend.abandoned_call.age", unit="s",
            description="How long an abandoned call ran on after it was abandoned (answered, "
                        "or cancelled when its leash ran out).",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS_S)
        self.backend_ejections = meter.create_counter(
            "rerank.backend.ejections", unit="{ejection}",
            description="Times an instance was taken out of the pool after failing calls "
                        "in a row.")
        self.backend_up = meter.create_gauge(
            "rerank.backend.up", unit="1",
            description="1 while the backend's /health answers 200, else 0.")
        self.llama_restarts = meter.create_counter(
            "rerank.llama_server.restarts", unit="{restart}",
            description="Restarts of the managed llama-server after it exited.")

    def watch_active(self, owner: object,
                     source: Callable[[], tuple[int, dict[str, str | int]]] | None) -> None:
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
        self.requests.add(1, {RERANKED: summary.reranked, REASON: reason,
                              BACKEND: summary.backend})
        self.candidates.record(summary.candidates)
        self.pairs_scored.record(summary.scored)
        if summary.scored - summary.cached:
            self.pairs.add(summary.scored - summary.cached,
                           {PAIR_OUTCOME: "scored", BACKEND: summary.backend})
        if summary.cached:
            self.pairs.add(summary.cached, {PAIR_OUTCOME: "cached", BACKEND: summary.backend})
        if summary.threshold is not None:
            self.threshold.record(summary.threshold.threshold)
            self.threshold_steps.record(summary.threshold.steps)
        for failure, n in summary.failures.items():
            self.pairs.add(n, {PAIR_OUTCOME: "failed", ERROR_TYPE: failure,
                               BACKEND: summary.backend})
        if summary.reranker_weight is not None:
            self.reranker_weight.record(summary.reranker_weight, {
                BACKEND: summary.backend, BLEND: summary.blend.value,
                BLEND_PROFILE: summary.blend_profile})
        self.duration.record(summary.total_ms / 1000)
        if summary.submitted:
            self.scoring_duration.record(summary.scoring_ms / 1000)
