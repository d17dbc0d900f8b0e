"""Trace context in (from a caller's metadata) and out (to a backend), without the
propagator API's detours where they change nothing (docs/observability.md, "Cost").
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import baggage, propagate, trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.context import Context
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.propagators.textmap import TextMapPropagator
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

# The last global propagator seen, the fields it reads, and whether it is the default.
_seen: tuple[TextMapPropagator | None, frozenset[str], bool] = (None, frozenset(), False)


def _textmap() -> tuple[TextMapPropagator, frozenset[str], bool]:
    global _seen
    textmap = propagate.get_global_textmap()
    if _seen[0] is not textmap:  # set at startup; tests may swap it
        kinds = [type(p) for p in getattr(textmap, "_propagators", ())]
        default = isinstance(textmap, CompositePropagator) and kinds == [
            TraceContextTextMapPropagator,
            W3CBaggagePropagator,
        ]
        _seen = (textmap, frozenset(textmap.fields), default)
    return textmap, _seen[1], _seen[2]


def incoming(carrier: Mapping[str, str]) -> Context:
    """The context a call's metadata continues: the caller's span, if it sent one."""
    textmap, fields, _ = _textmap()
    if fields.isdisjoint(carrier):
        return Context()  # what every propagator extracts from headers it does not find
    return textmap.extract(carrier)


def outgoing(span: trace.Span) -> dict[str, str]:
    """The headers that continue `span`'s trace."""
    _, _, default = _textmap()
    context = span.get_span_context()
    if default and context.is_valid and not baggage.get_all():
        headers = {
            "traceparent": f"00-{context.trace_id:032x}-{context.span_id:016x}-"
            f"{context.trace_flags:02x}"
        }
        if context.trace_state:
            headers["tracestate"] = context.trace_state.to_header()
        return headers
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return carrier
