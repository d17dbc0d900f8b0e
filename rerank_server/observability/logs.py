"""structlog configuration: JSON lines off a terminal, readable console output on one.

Tracebacks are rendered plainly, never with local variables: locals of the pipeline hold
query and document text, which must not reach the logs. While a sampled span is current
(tracing on), each line carries its `trace_id` and `span_id` so logs and traces join.
"""

from __future__ import annotations

import logging
import sys

import structlog
from opentelemetry import trace

from ..settings import LogFormat


def add_trace_ids(_logger: object, _name: str,
                  event: structlog.typing.EventDict) -> structlog.typing.EventDict:
    """Adds the current span's ids; nothing when no recording span is current."""
    context = trace.get_current_span().get_span_context()
    if context.is_valid:
        event["trace_id"] = format(context.trace_id, "032x")
        event["span_id"] = format(context.span_id, "016x")
    return event


def configure(level: str = "info", fmt: LogFormat = LogFormat.AUTO) -> None:
    use_json = fmt is LogFormat.JSON or (fmt is LogFormat.AUTO and not sys.stdout.isatty())
    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        add_trace_ids,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: structlog.typing.Processor
    if use_json:
        shared.append(structlog.processors.format_exc_info)
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(
            exception_formatter=structlog.dev.plain_traceback)
    structlog.configure(
        processors=[*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(sys.stdout),
        cache_logger_on_first_use=False,
    )
