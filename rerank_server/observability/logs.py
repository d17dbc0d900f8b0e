"""structlog configuration: JSON lines off a terminal, readable console output on one.

Tracebacks without local variables (they hold query and document text); trace ids joined.
"""

from __future__ import annotations

import io
import json
import logging
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from typing import Any, TextIO, cast

import orjson
import structlog
from opentelemetry import trace

from ..domain import RerankSummary
from ..settings import LogFormat

rpc_log = structlog.get_logger("rerank_server.rpc")


def add_trace_ids(
    _logger: object, _name: str, event: structlog.typing.EventDict
) -> structlog.typing.EventDict:
    """Adds the current span's ids; nothing when no recording span is current."""
    context = trace.get_current_span().get_span_context()
    if context.is_valid:
        event["trace_id"] = format(context.trace_id, "032x")
        event["span_id"] = format(context.span_id, "016x")
    return event


class _LineWriter:
    """Writes each line and its newline in one call, then flushes: the lines of several
    workers sharing stdout never run into each other (structlog's PrintLogger prints the
    newline apart). Without a stream it writes to `sys.stdout` as it is at the time, as
    PrintLogger does (tests capture it)."""

    # Re-entrant: a collection inside `write` can run a finalizer that logs (asyncio's
    # "Task exception was never retrieved", through `_LibraryRecords`) on this thread.
    _lock = threading.RLock()

    def __init__(self, stream: TextIO | None) -> None:
        self._stream = stream

    def msg(self, message: str) -> None:
        stream = self._stream or sys.stdout
        if not message.isascii():  # a lone surrogate (console lines are not escaped)
            message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        with self._lock:
            stream.write(message + "\n")
            stream.flush()

    debug = info = warning = warn = error = critical = exception = fatal = msg


def _json_line(event: Any, **options: Any) -> str:
    """An event as compact JSON, by orjson (an order of magnitude faster than the
    standard library's encoder on the `rpc` line). `options` carries structlog's
    `default` for objects JSON cannot hold (rendered with `repr`)."""
    try:
        return orjson.dumps(
            event, default=options.get("default"), option=orjson.OPT_NON_STR_KEYS
        ).decode()
    except TypeError:
        # What orjson refuses and the standard library writes: a lone surrogate (a
        # non-UTF-8 path read with surrogateescape), an integer beyond 64 bits.
        return json.dumps(event, **options)


class _LibraryRecords(logging.Handler):
    """What libraries log through the standard library at WARNING and above (uvicorn's
    "Invalid HTTP request received.", "Exception in ASGI application"), as our lines:
    without it Python's last-resort handler prints them as plain text, tracebacks with
    their messages, into a JSON log. An exception keeps its type and frames, not its
    message, which may quote the request (as `rpc_failed` does)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            error = record.exc_info[1] if record.exc_info else None
            fields: dict[str, Any] = {"logger": record.name}
            if error is None:
                fields["message"] = message
            else:  # the first line only: asyncio's next lines repr the failed task
                fields["message"] = message.split("\n", 1)[0]
                fields["error"] = type(error).__name__
                fields["stack"] = "".join(
                    traceback.format_list(traceback.extract_tb(error.__traceback__))
                )
            # structlog knows the standard levels only: a custom one goes to the next.
            level = min(max(record.levelno // 10 * 10, logging.WARNING), logging.CRITICAL)
            structlog.get_logger("library").log(level, "library_log", **fields)
        except Exception:  # never into the library's own call (a bad format, a write)
            self.handleError(record)


def _take_library_records() -> None:
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, _LibraryRecords)]:
        root.removeHandler(handler)  # configured again (tests, workers): one handler
    root.addHandler(_LibraryRecords(logging.WARNING))


def configure(
    level: str = "info",
    fmt: LogFormat = LogFormat.AUTO,
    stream: TextIO | io.TextIOBase | None = None,
    extra: Mapping[str, Any] | None = None,
) -> None:
    """Log lines to `stream` (default stdout); `extra` goes into every line (a worker's
    number)."""
    explicit = cast(TextIO | None, stream)
    stream = cast(TextIO, stream or sys.stdout)
    use_json = fmt is LogFormat.JSON or (fmt is LogFormat.AUTO and not stream.isatty())
    fixed = dict(extra or {})

    def add_extra(
        _logger: object, _name: str, event: structlog.typing.EventDict
    ) -> structlog.typing.EventDict:
        event.update(fixed)
        return event

    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        *([add_extra] if fixed else []),
        add_trace_ids,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: structlog.typing.Processor
    if use_json:
        shared.append(structlog.processors.format_exc_info)
        renderer = structlog.processors.JSONRenderer(serializer=_json_line)
    else:
        renderer = structlog.dev.ConsoleRenderer(exception_formatter=structlog.dev.plain_traceback)
    structlog.configure(
        processors=[*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=lambda *_args: _LineWriter(explicit),
        cache_logger_on_first_use=False,
    )
    _take_library_records()


def rpc_answered(rpc: str, s: RerankSummary, returned: int, **extra: Any) -> None:
    """The canonical log line of an answered rerank request (both edges): ids, counts,
    outcome and timings, never query or document text."""
    rpc_log.info(
        "rpc",
        rpc=rpc,
        status="OK",
        request_id=s.request_id,
        candidates=s.candidates,
        submitted=s.submitted,
        scored=s.scored,
        failed=s.failed,
        returned=returned,
        reranked=s.reranked,
        # Every reason, comma-separated ("partial,capped"), the first the main one.
        degraded=",".join(d.code.value for d in s.degraded_reasons) or None,
        degraded_detail="; ".join(d.message for d in s.degraded_reasons) or None,
        failures=dict(s.failures) or None,
        blend=s.blend.value,
        blend_profile=s.blend_profile or None,
        reranker_weight=None if s.reranker_weight is None else round(s.reranker_weight, 3),
        backend=s.backend,
        model=s.model or None,
        total_ms=round(s.total_ms, 2),
        scoring_ms=round(s.scoring_ms, 2),
        **extra,
    )


def rpc_cancelled(rpc: str, request_id: str, started: float, status: str) -> None:
    """The log line of a request that ended without an answer: its client cancelled it,
    or its deadline passed (gRPC then cancels the handler), or the server stopped."""
    rpc_log.info(
        "rpc",
        rpc=rpc,
        status=status,
        request_id=request_id,
        total_ms=round((time.perf_counter() - started) * 1000, 2),
    )


def rpc_failed(
    rpc: str, request_id: str, started: float, status: str, exc: Exception, *, internal: bool
) -> None:
    """The log line of a request that ended with an error status."""
    elapsed = round((time.perf_counter() - started) * 1000, 2)
    if internal:
        # The frames name our code, not user text; the message may not, so it is left out
        # (a rendered traceback would end with it).
        frames = "".join(traceback.format_list(traceback.extract_tb(exc.__traceback__)))
        rpc_log.error(
            "rpc",
            rpc=rpc,
            status=status,
            request_id=request_id,
            error=type(exc).__name__,
            total_ms=elapsed,
            stack=frames,
        )
    else:
        rpc_log.info(
            "rpc", rpc=rpc, status=status, request_id=request_id, error=str(exc), total_ms=elapsed
        )
