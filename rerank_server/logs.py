"""structlog configuration: JSON lines off a terminal, readable console output on one.

Tracebacks are rendered plainly, never with local variables: locals of the pipeline hold
query and document text, which must not reach the logs.
"""

from __future__ import annotations

import logging
import sys

import structlog

from .settings import LogFormat


def configure(level: str = "info", fmt: LogFormat = LogFormat.AUTO) -> None:
    use_json = fmt is LogFormat.JSON or (fmt is LogFormat.AUTO and not sys.stdout.isatty())
    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
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
