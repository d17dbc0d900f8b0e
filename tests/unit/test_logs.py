"""JSON log lines are written whatever the values: orjson's refusals fall back."""

from __future__ import annotations

import io
import json
import logging

import structlog

from rerank_server.observability import logs
from rerank_server.settings import LogFormat


def test_json_lines_are_compact_and_survive_what_orjson_refuses() -> None:
    stream = io.StringIO()
    before = structlog.get_config()
    logs.configure("info", LogFormat.JSON, stream=stream)
    try:
        log = structlog.get_logger("test")
        log.info("plain", n=3, ok=True, failures={"timeout": 2})
        # A non-UTF-8 file name read with surrogateescape; an integer beyond 64 bits.
        log.info("odd", model="/models/caf\udce9.gguf", big=2**70)
        log.info("object", value=object())
    finally:
        structlog.configure(**before)
    plain, odd, obj = stream.getvalue().splitlines()
    assert plain.startswith('{"n":3,"ok":true,"failures":{"timeout":2}')
    assert json.loads(plain)["event"] == "plain"
    assert json.loads(odd)["big"] == 2**70 and json.loads(odd)["model"].endswith(".gguf")
    assert json.loads(obj)["value"].startswith("<object object at")


def test_library_warnings_become_json_lines_without_exception_messages() -> None:
    """uvicorn logs through the standard library; its lines join ours, and an exception's
    message (which may quote a request) stays out, as in our own error lines."""
    stream = io.StringIO()
    before, root = structlog.get_config(), logging.getLogger()
    handlers = list(root.handlers)
    root.handlers[:] = []  # pytest's own would raise on the bad format below
    logs.configure("info", LogFormat.JSON, stream=stream)
    logs.configure("info", LogFormat.JSON, stream=stream)  # again: still one handler
    try:
        library = logging.getLogger("uvicorn.error")
        library.warning("Invalid HTTP request received.")
        text = "secret document text"  # the frames show the raising line, not this one
        try:
            raise UnicodeEncodeError("utf-8", text, 0, 1, "surrogate")
        except UnicodeEncodeError:
            library.exception("Exception in ASGI application")
        library.info("below the level: not written")
        library.log(35, "a level of its own")  # structlog knows the standard ones only
        library.warning("%d items", "not a number")  # the library's bug: not raised here
    finally:
        structlog.configure(**before)
        root.handlers[:] = handlers
    warning, failure, custom = (json.loads(line) for line in stream.getvalue().splitlines())
    assert warning["event"] == "library_log" and warning["level"] == "warning"
    assert warning["logger"] == "uvicorn.error"
    assert warning["message"] == "Invalid HTTP request received."
    assert failure["error"] == "UnicodeEncodeError" and "test_logs.py" in failure["stack"]
    assert "secret" not in stream.getvalue()
    assert custom["level"] == "warning" and custom["message"] == "a level of its own"


def test_console_lines_survive_a_lone_surrogate() -> None:
    """A JSON client's request id can hold one (refused, and logged as refused); on a
    terminal the console renderer does not escape it, and the write must not fail."""
    terminal = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")  # as stdout on a tty
    before = structlog.get_config()
    logs.configure("info", LogFormat.CONSOLE, stream=terminal)
    try:
        structlog.get_logger("test").info("rpc", request_id="\ud800x")
    finally:
        structlog.configure(**before)
    terminal.flush()
    assert b"\\ud800x" in terminal.buffer.getvalue()  # escaped, and written
