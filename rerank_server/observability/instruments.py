"""The server's metric instruments, made through OpenTelemetry's SDK or straight in the
Prometheus endpoint's registry (docs/observability.md, "How they are recorded").
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, Protocol

import prometheus_client
from opentelemetry.exporter.prometheus._mapping import (
    map_unit,
    sanitize_attribute,
    sanitize_full_name,
)
from opentelemetry.metrics import Meter
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from .. import __version__

Attributes = Mapping[str, str | bool | int | float]

# The instrumentation scope, as labels: OpenTelemetry's exporter puts them on every
# sample of the meter "rerank_server".
SCOPE_NAME = "rerank_server"
_SCOPE_LABELS = {
    "otel_scope_name": SCOPE_NAME,
    "otel_scope_schema_url": "",
    "otel_scope_version": __version__,
}


class Recorder(Protocol):
    """A histogram: OpenTelemetry's, or one recording straight into Prometheus."""

    def record(self, amount: float, attributes: Attributes | None = None) -> None: ...


class Adder(Protocol):
    """A counter or up-down counter."""

    def add(self, amount: float, attributes: Attributes | None = None) -> None: ...


class Setter(Protocol):
    """A gauge."""

    def set(self, amount: float, attributes: Attributes | None = None) -> None: ...


def label_value(value: object) -> str:
    """An attribute value as the exporter writes it as a label: strings as they are,
    anything else as JSON (`true`, `8080`)."""
    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(value)


class _Family:
    """One prometheus_client family and its labelled children, by attribute values."""

    def __init__(self, metric: MetricWrapperBase, keys: Sequence[str]) -> None:
        self._metric = metric
        self._keys = tuple(keys)
        self._children: dict[tuple[tuple[str, object], ...] | None, Any] = {}

    def child(self, attributes: Attributes | None) -> Any:
        # Keyed by the attributes as given, so every new set of keys is checked once
        # (prometheus_client hands out one child per label values however it is asked).
        key = tuple(attributes.items()) if attributes else None
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._labelled(attributes or {})
        return child

    def _labelled(self, attributes: Attributes) -> Any:
        unknown = set(attributes) - set(self._keys)
        if unknown:
            raise ValueError(
                f"{self._metric._name}: attribute(s) {sorted(unknown)} not "
                "declared for this instrument"
            )
        labels = {sanitize_attribute(key): label_value(attributes.get(key)) for key in self._keys}
        return self._metric.labels(**labels, **_SCOPE_LABELS)


class _Histogram(_Family):
    def record(self, amount: float, attributes: Attributes | None = None) -> None:
        self.child(attributes).observe(amount)


class _Counter(_Family):
    """A counter, or with a prometheus_client gauge under it, an up-down counter."""

    def add(self, amount: float, attributes: Attributes | None = None) -> None:
        self.child(attributes).inc(amount)


class _Gauge(_Family):
    def set(self, amount: float, attributes: Attributes | None = None) -> None:
        self.child(attributes).set(amount)


class Instruments:
    """Makes instruments on `meter`, or directly in `registry` when one is given.

    A direct family declares its attribute keys up front and refuses an undeclared one:
    the exporter gives a family the union of its samples' keys ("" where a sample has
    none, which Prometheus reads as absent). It has no cardinality limit (the SDK's is
    2,000 series a family): every attribute value the server records is from a closed set.
    """

    def __init__(self, meter: Meter, registry: CollectorRegistry | None) -> None:
        self._meter = meter
        self._registry = registry
        if registry is not None:
            # No `_created` series, as OpenTelemetry's exporter has none; nothing else
            # in the process uses prometheus_client's own metrics.
            prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]

    @property
    def direct(self) -> bool:
        return self._registry is not None

    def _wrapper(
        self,
        kind: type[MetricWrapperBase],
        name: str,
        unit: str,
        description: str,
        keys: Sequence[str],
        **extra: Any,
    ) -> MetricWrapperBase:
        labels = sorted([*(sanitize_attribute(key) for key in keys), *_SCOPE_LABELS])
        # prometheus_client appends the unit (and `_total` for counters) as the
        # exporter's families do.
        return kind(
            sanitize_full_name(name),
            description,
            labels,
            registry=self._registry,
            unit=map_unit(unit),
            **extra,
        )

    def histogram(
        self,
        name: str,
        unit: str,
        description: str,
        buckets: Sequence[float],
        keys: Sequence[str] = (),
    ) -> Recorder:
        if self._registry is None:
            return self._meter.create_histogram(
                name,
                unit=unit,
                description=description,
                explicit_bucket_boundaries_advisory=buckets,
            )
        return _Histogram(
            self._wrapper(
                prometheus_client.Histogram, name, unit, description, keys, buckets=buckets
            ),
            keys,
        )

    def counter(self, name: str, unit: str, description: str, keys: Sequence[str] = ()) -> Adder:
        if self._registry is None:
            return self._meter.create_counter(name, unit=unit, description=description)
        return _Counter(
            self._wrapper(prometheus_client.Counter, name, unit, description, keys), keys
        )

    def up_down_counter(
        self, name: str, unit: str, description: str, keys: Sequence[str] = ()
    ) -> Adder:
        if self._registry is None:
            return self._meter.create_up_down_counter(name, unit=unit, description=description)
        # The exporter renders a cumulative non-monotonic sum as a gauge.
        return _Counter(self._wrapper(prometheus_client.Gauge, name, unit, description, keys), keys)

    def gauge(self, name: str, unit: str, description: str, keys: Sequence[str] = ()) -> Setter:
        if self._registry is None:
            return self._meter.create_gauge(name, unit=unit, description=description)
        return _Gauge(self._wrapper(prometheus_client.Gauge, name, unit, description, keys), keys)


def bound(histogram: Recorder, attributes: Attributes) -> Callable[[float], None]:
    """A record into `histogram` with `attributes` fixed: for a direct one, the labelled
    child's own `observe`, so a hot caller skips even the attribute lookup."""
    if isinstance(histogram, _Histogram):
        observe: Callable[[float], None] = histogram.child(attributes).observe
        return observe
    return partial(histogram.record, attributes=attributes)
