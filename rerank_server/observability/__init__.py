"""Logs, metrics and traces: structlog configuration, every metric instrument, and the
OpenTelemetry providers with their Prometheus endpoint and OTLP export."""
