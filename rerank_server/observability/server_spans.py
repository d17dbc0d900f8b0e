"""A request's SERVER span, opened and closed the same way by both edges (the gRPC
interceptor and the JSON API's gate).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextvars import Token

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.util.types import AttributeValue

from . import propagation

Opened = tuple[trace.Span, Token[otel_context.Context]]


def open_server_span(
    tracer: trace.Tracer,
    name: str,
    carrier: Mapping[str, str],
    attributes: Mapping[str, AttributeValue],
) -> Opened:
    """A SERVER span, a child of the caller's span when `carrier` names one, current from
    here until `close_server_span`."""
    span = tracer.start_span(
        name,
        context=propagation.incoming(carrier),
        kind=trace.SpanKind.SERVER,
        attributes=attributes,
    )
    return span, otel_context.attach(trace.set_span_in_context(span))


def close_server_span(
    opened: Opened, attributes: Mapping[str, AttributeValue], fault: str | None = None
) -> None:
    """No longer current; `attributes` added; status ERROR with `fault` when the server
    failed the request (not for a caller's mistake); ended."""
    span, token = opened
    otel_context.detach(token)
    span.set_attributes(attributes)
    if fault is not None:
        span.set_status(trace.StatusCode.ERROR, fault)
    span.end()
