"""One definition per setting: flags, RERANK_* variables, precedence and clear errors."""

from __future__ import annotations

import re

import pytest

from rerank_server.domain import BlendStrategy
from rerank_server.errors import ConfigError
from rerank_server.settings import Settings, build_parser, load


def test_defaults_are_safe() -> None:
    s = load([], environ={})
    assert (s.host, s.port) == ("127.0.0.1", 50051)
    assert s.backend_url == "http://127.0.0.1:8080"
    assert s.blend_strategy is BlendStrategy.PROFILE  # the shipped profiles, else adaptive
    assert (s.max_candidates, s.max_request_candidates, s.min_candidates) == (100, 100, 1)
    assert (s.max_chunk_chars, s.concurrency) == (2000, 4)


def test_environment_then_flag_precedence() -> None:
    env = {"RERANK_PORT": "6000", "RERANK_BLEND_STRATEGY": "linear", "RERANK_REFLECTION": "off"}
    s = load([], environ=env)
    assert (s.port, s.blend_strategy, s.reflection) == (6000, BlendStrategy.LINEAR, False)
    s = load(["--port", "7000", "--reflection"], environ=env)
    assert (s.port, s.reflection) == (7000, True)


def test_a_flag_wins_over_a_variable_it_could_not_read() -> None:
    """`RERANK_PORT=abc rerank-server --port 1234` (and `--help`) failed on the variable
    the flag replaces."""
    env = {"RERANK_PORT": "abc"}
    assert load(["--port", "1234"], environ=env).port == 1234
    assert re.search(r"\(default:\s+abc\)", build_parser(environ=env).format_help())
    with pytest.raises(ConfigError, match=r"^RERANK_PORT: cannot read 'abc' as int$"):
        load(["--concurrency", "2"], environ=env)


def test_every_setting_has_flag_and_env_in_help() -> None:
    text = build_parser(environ={}).format_help()
    import dataclasses

    for f in dataclasses.fields(Settings):
        assert "--" + f.name.replace("_", "-") in text
        assert "RERANK_" + f.name.upper() in text


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"RERANK_PORT": "abc"}, "RERANK_PORT"),
        ({"RERANK_PORT": "70000"}, "--port / RERANK_PORT"),
        ({"RERANK_CONCURRENCY": "0"}, "--concurrency / RERANK_CONCURRENCY"),
        ({"RERANK_BLEND_STRATEGY": "magic"}, "position_aware"),
        ({"RERANK_BACKEND_URL": "localhost:8080"}, "--backend-url"),
        ({"RERANK_BACKEND": "nope"}, "RERANK_BACKEND: cannot read 'nope'"),
        ({"RERANK_LOG_LEVEL": "loud"}, "--log-level"),
        ({"RERANK_DISABLED": "maybe"}, "RERANK_DISABLED"),
        # nan passes every bound check (nan < 0 is false) and then breaks what reads it
        ({"RERANK_GRACE_PERIOD_S": "nan"}, "RERANK_GRACE_PERIOD_S: cannot read 'nan'"),
        ({"RERANK_LLAMA_READY_TIMEOUT_S": "inf"}, "RERANK_LLAMA_READY_TIMEOUT_S"),
        # Path("") is the working directory: the cache would land wherever the server started
        ({"RERANK_CACHE_DIR": ""}, "RERANK_CACHE_DIR: cannot read ''"),
        # split at start, not after minutes of building the assets
        ({"RERANK_LLAMA_ARGS": '-t "4'}, "--llama-args / RERANK_LLAMA_ARGS: cannot split"),
        # gRPC takes 32-bit ints: past them, an OverflowError's traceback at start-up
        (
            {"RERANK_MAX_MESSAGE_BYTES": str(2**31)},
            "--max-message-bytes / RERANK_MAX_MESSAGE_BYTES: must be between",
        ),
        ({"RERANK_MAX_CONNECTIONS": str(2**31)}, "--max-connections / RERANK_MAX_CONNECTIONS"),
    ],
)
def test_bad_values_name_the_setting(env: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace("/", ".")):
        load([], environ=env)


def test_configuration_doc_lists_every_setting() -> None:
    """docs/configuration.md stays true: every flag and variable is in it."""
    import dataclasses
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    for f in dataclasses.fields(Settings):
        assert f"`--{f.name.replace('_', '-')}`" in doc
        assert f"`RERANK_{f.name.upper()}`" in doc
