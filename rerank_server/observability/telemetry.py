"""Telemetry wiring: meter and tracer providers, the Prometheus endpoint, OTLP export.

What is on when, and the `OTEL_*` variables it honours: docs/observability.md, "Settings".
"""

from __future__ import annotations

import os
import socket
import socketserver
import threading
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server
from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

import structlog
from opentelemetry import trace
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import NoOpMeterProvider
from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter, MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from prometheus_client import CollectorRegistry, make_wsgi_app

from .. import __version__
from ..domain import RerankSummary
from ..errors import BindError
from ..settings import Settings, host_port
from .lean_spans import lean_tracer
from .logs import rpc_answered
from .metrics import Metrics

log = structlog.get_logger(__name__)

SERVICE = "rerank-server"


class _Untraced(AbstractContextManager[trace.Span]):
    """A step's span when none is made (tracing off, or no `--trace-steps`): nothing is
    started, made current or ended."""

    def __enter__(self) -> trace.Span:
        return trace.INVALID_SPAN

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None


_UNTRACED = _Untraced()


@dataclass
class Telemetry:
    """What the server records telemetry with, and what must be flushed at shutdown.

    Each server owns its providers (none is installed globally), so two servers in one
    process (the tests) do not mix their numbers, and shutdown flushes exactly this one's.
    """

    metrics: Metrics
    tracer: trace.Tracer
    tracer_provider: TracerProvider | None = None
    meter_provider: MeterProvider | None = None
    metrics_server: WSGIServer | None = None
    trace_steps: bool = False  # `--trace-steps`: spans for the CPU-only steps too

    @property
    def tracing(self) -> bool:
        return self.tracer_provider is not None

    def step(self, name: str) -> AbstractContextManager[trace.Span]:
        """The span of one CPU-only step of a request, current inside the `with` block,
        with `--trace-steps`. Otherwise nothing: even OpenTelemetry's no-op tracer builds
        two context managers and switches the context for each step."""
        if self.tracer_provider is None or not self.trace_steps:
            return _UNTRACED
        return self.tracer.start_as_current_span(name)

    def request_span(self) -> trace.Span | None:
        """The current span, for an edge whose span stands for exactly one request and
        outlives its pipeline (a unary Rerank call's server span, a JSON API request's):
        the request's scoring reports into it rather than into a `rerank.score` span of
        its own, one span fewer per request. None with tracing off, and with
        `--trace-steps`, where `rerank.score` is one of the steps."""
        if self.tracer_provider is None or self.trace_steps:
            return None
        return trace.get_current_span()

    def answered(self, rpc: str, summary: RerankSummary, returned: int, **extra: Any) -> None:
        """How both edges finish an answered rerank request: its canonical log line
        (`logs.rpc_answered`) and its metrics."""
        rpc_answered(rpc, summary, returned, **extra)
        self.metrics.record_rerank(summary)

    @property
    def metrics_port(self) -> int | None:
        return None if self.metrics_server is None else self.metrics_server.server_port

    @classmethod
    def disabled(cls) -> Telemetry:
        return cls(Metrics.noop(), trace.NoOpTracer())

    @classmethod
    def create(
        cls,
        settings: Settings,
        *,
        span_processor: SpanProcessor | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> Telemetry:
        """Providers for `settings`; `span_processor` (tests, benchmarks) gets every span."""
        environ = os.environ if environ is None else environ
        resource = _resource(environ)
        endpoint = settings.otlp_endpoint or ""

        readers: list[MetricReader] = []
        registry = None
        if settings.metrics:
            registry = CollectorRegistry(auto_describe=True)
            readers.append(PrometheusMetricReader(registry=registry))
        # The OTLP exporters are imported only when used: they load protos and a gRPC
        # client nobody needs without a collector.
        otlp_metrics = _otlp_wanted("METRICS", endpoint, environ)
        if otlp_metrics:
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
                OTLPMetricExporter,
            )

            readers.append(
                PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=endpoint or None))
            )
        # Exemplars (trace ids sampled into metrics) only leave over OTLP; the Prometheus
        # text format we serve drops them, and sampling them costs a noticeable share of a
        # request's CPU with tracing on. OTEL_METRICS_EXEMPLAR_FILTER still decides when set.
        exemplars = (
            None
            if otlp_metrics or "OTEL_METRICS_EXEMPLAR_FILTER" in environ
            else AlwaysOffExemplarFilter()
        )
        meter_provider = (
            MeterProvider(metric_readers=readers, resource=resource, exemplar_filter=exemplars)
            if readers
            else None
        )
        # With OTLP metrics on, every instrument goes through the SDK so both exports
        # carry it; otherwise the per-call one records into the registry directly.
        metrics = Metrics(
            meter_provider or NoOpMeterProvider(), prometheus=None if otlp_metrics else registry
        )

        tracer_provider = None
        tracer: trace.Tracer = trace.NoOpTracer()
        if span_processor is not None or _otlp_wanted("TRACES", endpoint, environ):
            tracer_provider = TracerProvider(resource=resource)
            if span_processor is None:
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                    OTLPSpanExporter,
                )

                span_processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint or None))
            tracer = lean_tracer(tracer_provider, span_processor, "rerank_server", __version__)

        telemetry = cls(
            metrics, tracer, tracer_provider, meter_provider, trace_steps=settings.trace_steps
        )
        if registry is not None:
            telemetry._serve_metrics(settings, registry)
        return telemetry

    def _serve_metrics(self, settings: Settings, registry: CollectorRegistry) -> None:
        try:
            self.metrics_server = metrics_endpoint(settings, make_wsgi_app(registry))
        except BindError:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        """Stop the metrics endpoint and flush what is buffered for export."""
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()
            self.metrics_server = None
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()
        if self.meter_provider is not None:
            self.meter_provider.shutdown()


def _resource(environ: Mapping[str, str]) -> Resource:
    attributes: dict[str, str] = {"service.version": __version__}
    if "OTEL_SERVICE_NAME" not in environ:
        attributes["service.name"] = SERVICE
    return Resource.create(attributes)


def _otlp_wanted(signal: str, endpoint: str, environ: Mapping[str, str]) -> bool:
    """Whether `signal` (TRACES or METRICS) should go out over OTLP."""
    if environ.get(f"OTEL_{signal}_EXPORTER", "").strip().lower() == "none":
        return False
    return bool(
        endpoint
        or environ.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT")
        or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )


class _ThreadingServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass  # scrapes every few seconds would flood the log


def _only_metrics(app: WSGIApplication) -> WSGIApplication:
    """`app` at `/metrics`, 404 everywhere else: an HTTP probe or a typo must fail."""

    def serve(environ: WSGIEnvironment, start_response: StartResponse) -> list[bytes]:
        if environ.get("PATH_INFO") != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found: this port serves /metrics only\n"]
        return list(app(environ, start_response))

    return serve


def metrics_endpoint(settings: Settings, app: WSGIApplication) -> WSGIServer:
    """`app` served at `/metrics` on `--metrics-host`/`--metrics-port`; a port in use is a
    `BindError` naming the flag."""
    host = settings.metrics_host or settings.host
    try:
        return _metrics_server(host, settings.metrics_port, app)
    except OSError as exc:
        raise BindError(
            "--metrics-port / RERANK_METRICS_PORT",
            host_port(host, settings.metrics_port),
            exc.strerror or "",
        ) from None


def _metrics_server(host: str, port: int, app: WSGIApplication) -> WSGIServer:
    """The Prometheus endpoint in a daemon thread."""
    server_class = type(
        "_Server",
        (_ThreadingServer,),
        {"address_family": socket.AF_INET6 if ":" in host else socket.AF_INET},
    )
    server: WSGIServer = make_server(
        host, port, _only_metrics(app), server_class, handler_class=_QuietHandler
    )
    threading.Thread(target=server.serve_forever, daemon=True, name="metrics-endpoint").start()
    return server
