"""The trace a request's backend calls continue, worked out once per request.

`score_within` starts a request's `rerank.score` span and, with tracing on, stores the
W3C `traceparent` (and baggage) that continue it in a context variable the scorer's tasks
inherit; every backend call sends them as they are. Looking the current span up and
checking it for each of a `chat` request's 40 calls cost about a tenth of what tracing
added to the request.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from opentelemetry import propagate, trace

# The trace headers as a dict (httpx) and as request head lines (the lean transport).
TraceHeaders = tuple[dict[str, str], bytes]

_CURRENT: ContextVar[TraceHeaders | None] = ContextVar("rerank_trace_headers", default=None)


def headers_for(span: trace.Span) -> TraceHeaders:
    """The headers that continue `span`'s trace."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
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
