"""The trace a request's backend calls continue, worked out once per request."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from opentelemetry import trace

from ...observability import propagation

# The trace headers as a dict (httpx) and as request head lines (the lean transport).
TraceHeaders = tuple[dict[str, str], bytes]

_CURRENT: ContextVar[TraceHeaders | None] = ContextVar("rerank_trace_headers", default=None)


def headers_for(span: trace.Span) -> TraceHeaders:
    """The headers that continue `span`'s trace."""
    carrier = propagation.outgoing(span)
    lines = b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in carrier.items())
    return carrier, lines


@contextmanager
def continuing(span: trace.Span) -> Iterator[None]:
    """Backend calls made in tasks started inside continue `span`'s trace."""
    token = _CURRENT.set(headers_for(span) if span.is_recording() else None)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current() -> TraceHeaders | None:
    """The headers for a backend call made here; None outside a traced request."""
    return _CURRENT.get()
