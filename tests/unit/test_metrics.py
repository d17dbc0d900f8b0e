"""The per-call duration histogram renders the same through either of its two paths."""

from __future__ import annotations

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter, MeterProvider
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rerank_server.observability.metrics import Instance, Metrics

FAMILY = "http_client_request_duration_seconds"
CALLS = [  # seconds, instance, status, error type
    (0.003, Instance("chat", "127.0.0.1", 8080), 200, None),
    (0.004, Instance("chat", "127.0.0.1", 8080), 200, None),
    (0.07, Instance("chat", "127.0.0.1", 8080), 503, "http_status"),
    (30.0, Instance("chat", "127.0.0.1", 8080), None, "timeout"),
    (0.012, Instance("chat", "10.0.0.2", 8081), 200, None),
    (0.0001, Instance("chat", "10.0.0.2", 8081), None, "connect"),
]


def _rendered(direct: bool) -> set[tuple[str, tuple[tuple[str, str], ...], float]]:
    registry = CollectorRegistry(auto_describe=True)
    provider = MeterProvider(metric_readers=[PrometheusMetricReader(registry=registry)],
                             exemplar_filter=AlwaysOffExemplarFilter())
    metrics = Metrics(provider, prometheus=registry if direct else None)
    for seconds, instance, status, error_type in CALLS:
        metrics.call_durations.record(seconds, instance, status, error_type)
    families = [f for f in text_string_to_metric_families(generate_latest(registry).decode())
                if f.name == FAMILY]
    assert len(families) == 1
    (family,) = families
    assert family.type == "histogram"
    provider.shutdown()
    return {(s.name, tuple(sorted(s.labels.items())), s.value) for s in family.samples}


def test_direct_histogram_renders_as_opentelemetry_does() -> None:
    through_sdk = _rendered(direct=False)
    direct = _rendered(direct=True)
    assert direct == through_sdk
    # And it holds what was recorded: six calls, one 30 s timeout past every bucket.
    counts = {dict(labels).get("error_type", ""): value for name, labels, value in direct
              if name == f"{FAMILY}_count" and dict(labels)["server_port"] == "8080"}
    assert counts == {"": 2.0, "http_status": 1.0, "timeout": 1.0}
    over = [value for name, labels, value in direct
            if name == f"{FAMILY}_bucket" and dict(labels)["le"] == "15.0"
            and dict(labels)["error_type"] == "timeout"]
    assert over == [0.0]
