"""The trace-context shortcuts write and read exactly what OpenTelemetry's propagators do."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry import baggage, context, propagate, trace
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanContext, TraceFlags, TraceState
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from rerank_server.observability import propagation

TRACER = TracerProvider().get_tracer("test")
PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _through_api(span: trace.Span) -> dict[str, str]:
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


@pytest.fixture
def only_tracecontext() -> Iterator[None]:
    default = propagate.get_global_textmap()
    propagate.set_global_textmap(CompositePropagator([TraceContextTextMapPropagator()]))
    yield
    propagate.set_global_textmap(default)


@pytest.mark.parametrize("state", [None, TraceState([("vendor", "x1"), ("other", "y")])])
@pytest.mark.parametrize("flags", [TraceFlags.DEFAULT, TraceFlags.SAMPLED])
def test_outgoing_writes_what_the_default_propagators_write(
    state: TraceState | None, flags: int
) -> None:
    parent = trace.NonRecordingSpan(
        SpanContext(
            0x4BF92F3577B34DA6A3CE929D0E0E4736,
            0x00F067AA0BA902B7,
            is_remote=True,
            trace_flags=TraceFlags(flags),
            trace_state=state,
        )
    )
    span = TRACER.start_span("s", context=trace.set_span_in_context(parent))
    assert propagation.outgoing(span) == _through_api(span)
    assert propagation.outgoing(span)["traceparent"].startswith(
        "00-4bf92f3577b34da6a3ce929d0e0e4736-"
    )
    assert propagation.outgoing(trace.INVALID_SPAN) == _through_api(trace.INVALID_SPAN) == {}


def test_outgoing_carries_baggage_through_the_api() -> None:
    span = TRACER.start_span("s")
    token = context.attach(baggage.set_baggage("tenant", "a"))
    try:
        headers = propagation.outgoing(span)
        assert headers == _through_api(span)
        assert headers["baggage"] == "tenant=a"
    finally:
        context.detach(token)


def test_other_propagators_are_used_as_configured(only_tracecontext: None) -> None:
    span = TRACER.start_span("s")
    token = context.attach(baggage.set_baggage("tenant", "a"))
    try:
        assert propagation.outgoing(span) == _through_api(span)
        assert "baggage" not in propagation.outgoing(span)
    finally:
        context.detach(token)
    incoming = propagation.incoming({"traceparent": PARENT, "baggage": "tenant=a"})
    assert baggage.get_all(incoming) == {}  # this propagator does not read baggage
    assert trace.get_current_span(incoming).get_span_context().span_id == 0x00F067AA0BA902B7


def test_incoming_reads_a_callers_span_and_nothing_without_one() -> None:
    carrier = {"traceparent": PARENT, "baggage": "tenant=a", "authorization": "Bearer t"}
    ours, api = propagation.incoming(carrier), propagate.extract(carrier)
    assert (
        trace.get_current_span(ours).get_span_context()
        == trace.get_current_span(api).get_span_context()
    )
    assert baggage.get_all(ours) == baggage.get_all(api) == {"tenant": "a"}
    plain = {"authorization": "Bearer t", "user-agent": "grpc-python"}
    assert propagation.incoming(plain) == propagate.extract(plain) == context.Context()
