"""JSON log lines are written whatever the values: orjson's refusals fall back."""

from __future__ import annotations

import io
import json

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
