"""Every instrument renders the same whether it records through OpenTelemetry's SDK or
straight into the Prometheus registry (`observability/instruments.py`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter, MeterProvider
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rerank_server.domain import (
    BlendStrategy,
    Degraded,
    DegradedCode,
    RerankSummary,
    ThresholdReport,
)
from rerank_server.managed.llama_server import ManagedLlamaServer
from rerank_server.observability.metrics import (
    BACKEND,
    CACHE_RESULT,
    LIMIT,
    REASON,
    RERANKED,
    RPC_METHOD,
    RPC_STATUS,
    RPC_SYSTEM_NAME,
    TOKEN,
    Instance,
    Metrics,
)
from rerank_server.observability.worker_metrics import SupervisorMetrics, merge

CHAT = Instance("chat", "127.0.0.1", 8080)
OTHER = Instance("chat", "10.0.0.2", 8081)
CALLS = [  # seconds, instance, status, error type
    (0.003, CHAT, 200, None),
    (0.004, CHAT, 200, None),
    (0.07, CHAT, 503, "http_status"),
    (30.0, CHAT, None, "timeout"),
    (0.012, OTHER, 200, None),
    (0.0001, OTHER, None, "connect"),
]


def _summary(**changes: object) -> RerankSummary:
    fields: dict[str, object] = dict(
        request_id="r",
        reranked=True,
        degraded_reasons=(),
        backend="chat",
        model="m",
        blend=BlendStrategy.POSITION_AWARE,
        candidates=40,
        submitted=40,
        scored=40,
        failed=0,
        total_ms=12.0,
        scoring_ms=9.5,
    )
    fields.update(changes)
    return RerankSummary(**fields)  # type: ignore[arg-type]


SUMMARIES = [
    _summary(),
    _summary(candidates=7, submitted=7, scored=5, cached=2, total_ms=3.0, scoring_ms=1.0),
    _summary(
        reranked=False,
        degraded_reasons=(Degraded(DegradedCode.TIMEOUT, "budget spent"),),
        scored=30,
        failed=10,
        failures={"timeout": 10},
        total_ms=250.0,
    ),
    _summary(
        blend=BlendStrategy.ADAPTIVE, reranker_weight=0.75, threshold=ThresholdReport(0.5, 2, 10)
    ),
    _summary(
        blend=BlendStrategy.PROFILE,
        blend_profile="scifact",
        reranker_weight=0.0,
        submitted=0,
        scored=0,
    ),
]


def _record(metrics: Metrics) -> None:
    """A bit of everything the server records."""
    for seconds, instance, status, error_type in CALLS:
        metrics.call_durations.record(seconds, instance, status, error_type)
    for summary in SUMMARIES:
        metrics.record_rerank(summary)
    method = "rerank.v1.Reranker/Rerank"
    metrics.rpc_active.add(1, {RPC_METHOD: method})
    metrics.rpc_active.add(1, {RPC_METHOD: method})
    metrics.rpc_active.add(-1, {RPC_METHOD: method})
    metrics.rpc_rejected.add(1, {RPC_METHOD: method})
    metrics.limit_refusals.add(1, {TOKEN: "svc-a", LIMIT: "rps"})
    metrics.limit_counter_errors.add(1, {LIMIT: "rps", "error.type": "timeout"})
    metrics.limit_counter_errors.add(2, {LIMIT: "concurrent", "error.type": "down"})
    metrics.rpc_duration.record(
        0.02, {RPC_SYSTEM_NAME: "grpc", RPC_METHOD: method, RPC_STATUS: "OK"}
    )
    metrics.rpc_duration.record(
        0.5, {RPC_SYSTEM_NAME: "grpc", RPC_METHOD: method, RPC_STATUS: "INVALID_ARGUMENT"}
    )
    metrics.cache_lookups.add(3, {CACHE_RESULT: "hit"})
    metrics.cache_lookups.add(0, {CACHE_RESULT: "miss"})
    metrics.cache_lookups.add(2, {CACHE_RESULT: "hit", "rerank.cache.tier": "shared"})
    metrics.cache_shared_duration.record(0.0008)
    metrics.cache_shared_duration.record(0.005, {"error.type": "timeout"})
    metrics.backend_errors.add(1, {**CHAT.attributes, "error.type": "timeout"})
    metrics.abandoned_calls.add(1, CHAT.attributes)
    metrics.abandoned_open.add(1, CHAT.attributes)
    metrics.abandoned_open.add(-1, CHAT.attributes)
    metrics.abandoned_age.record(0.3, CHAT.attributes)
    metrics.backend_ejections.add(1, OTHER.attributes)
    metrics.backend_up.set(1, CHAT.attributes)
    metrics.backend_up.set(0, OTHER.attributes)
    metrics.llama_restarts.add(1)
    metrics.watch_active(CHAT, lambda: (2, CHAT.attributes))  # read by the SDK either way


Sample = tuple[str, tuple[tuple[str, str], ...], float]


def _rendered(direct: bool) -> dict[str, tuple[str, set[Sample]]]:
    """Family name -> (type, samples), as a Prometheus server reads them: a label with an
    empty value is no label."""
    registry = CollectorRegistry(auto_describe=True)
    provider = MeterProvider(
        metric_readers=[PrometheusMetricReader(registry=registry)],
        exemplar_filter=AlwaysOffExemplarFilter(),
    )
    metrics = Metrics(provider, prometheus=registry if direct else None)
    _record(metrics)
    families = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        samples = set()
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if v != ""}
            samples.add((s.name, tuple(sorted(labels.items())), s.value))
        families[family.name] = (family.type, samples)
    provider.shutdown()
    return families


def test_every_instrument_renders_directly_as_opentelemetry_renders_it() -> None:
    through_sdk = _rendered(direct=False)
    direct = _rendered(direct=True)
    assert set(direct) == set(through_sdk)
    for name in through_sdk:
        assert direct[name] == through_sdk[name], name
    # Every instrument was recorded: 24 direct families, the observed active requests
    # and the exporter's target_info.
    assert len(direct) == 26
    assert direct["rerank_requests"][0] == "counter"
    assert direct["rerank_server_active_rpcs"][0] == "gauge"
    assert direct["rerank_backend_up"][0] == "gauge"


def test_direct_histogram_holds_what_was_recorded() -> None:
    (_, samples) = _rendered(direct=True)["http_client_request_duration_seconds"]
    family = "http_client_request_duration_seconds"
    counts = {
        dict(labels).get("error_type", ""): value
        for name, labels, value in samples
        if name == f"{family}_count" and dict(labels)["server_port"] == "8080"
    }
    assert counts == {"": 2.0, "http_status": 1.0, "timeout": 1.0}
    # The 30 s timeout is past every bucket but +Inf.
    over = [
        value
        for name, labels, value in samples
        if name == f"{family}_bucket"
        and dict(labels)["le"] == "15.0"
        and dict(labels).get("error_type") == "timeout"
    ]
    assert over == [0.0]
    (_, requests) = _rendered(direct=True)["rerank_requests"]
    by_reason = {dict(labels)["rerank_degraded_reason"]: value for _, labels, value in requests}
    assert by_reason == {"none": 4.0, "timeout": 1.0}


def test_an_undeclared_attribute_is_refused_even_after_a_declared_one() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(MeterProvider(), prometheus=registry)
    metrics.rpc_active.add(1, {RPC_METHOD: "m"})
    with pytest.raises(ValueError, match=r"rerank\.backend"):
        metrics.rpc_active.add(1, {RPC_METHOD: "m", "rerank.backend": "chat"})


def test_merged_metrics_hold_the_supervisors_series_unlabelled_beside_the_workers() -> None:
    """`--workers`' one /metrics: each family declared once, the workers' samples labelled
    `worker`, the supervisor's own (restart counters, from 0) without that label, and a
    worker that did not answer shown as down."""
    registry = CollectorRegistry(auto_describe=True)
    worker = Metrics(MeterProvider(), prometheus=registry)
    worker.requests.add(2, {RERANKED: True, REASON: "none", BACKEND: "chat"})
    own = SupervisorMetrics()
    ManagedLlamaServer(
        Path("llama-server"),
        Path("model.gguf"),
        slots=1,
        ctx_per_slot=512,
        restart_counter=own.llama_restarts,
    )  # as in managed mode: shown at 0
    own.worker_restarts.add(1)
    text = merge({"0": generate_latest(registry).decode(), "1": None}, own.text()).decode()

    assert text.count("# TYPE rerank_llama_server_restarts_total counter") == 1
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    restarts = {(s.name, s.labels.get("worker")): s.value for s in samples if "restarts" in s.name}
    assert restarts == {
        ("rerank_llama_server_restarts_total", None): 0.0,
        ("rerank_worker_restarts_total", None): 1.0,
    }
    assert [
        (s.labels["worker"], s.value) for s in samples if s.name == "rerank_requests_total"
    ] == [("0", 2.0)]
    assert {s.labels["worker"]: s.value for s in samples if s.name == "rerank_worker_up"} == {
        "0": 1.0,
        "1": 0.0,
    }


def test_without_managed_mode_the_supervisor_shows_no_llama_server_restarts() -> None:
    text = SupervisorMetrics().text()
    assert [s.name for f in text_string_to_metric_families(text) for s in f.samples] == [
        "rerank_worker_restarts_total"
    ]
