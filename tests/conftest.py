"""Shared fixtures: a fake llama-server on loopback, and a real in-process gRPC server."""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest
import structlog
from rerank_client import AsyncRerankClient

from rerank_server.observability import logs
from rerank_server.server import RunningServer, build_server
from rerank_server.settings import LogFormat, Settings
from tests.fakes.llama import FakeLlamaServer
from tests.fakes.redis_server import RedisServer

logs.configure("debug", LogFormat.JSON)


@pytest.fixture(autouse=True)
def _logging_as_configured() -> Iterator[None]:
    """A test that runs a CLI's `main` in-process sets up logging as that CLI does
    (`eval` at warning): put the suite's back, so later tests' log lines are written and
    `capture_logs` sees them."""
    before = structlog.get_config()
    yield
    structlog.configure(**before)


@pytest.fixture
def fake_llama() -> Iterator[FakeLlamaServer]:
    fake = FakeLlamaServer().start()
    yield fake
    fake.stop()


StartServer = Callable[..., Awaitable[RunningServer]]


def client_of(server: RunningServer, **options: Any) -> AsyncRerankClient:
    """A client of the server under test, on loopback (`async with client_of(s) as c`);
    `options` are the client's own (a token, TLS, its own connection)."""
    return AsyncRerankClient(f"127.0.0.1:{server.port}", **options)


@pytest.fixture
async def start_server(fake_llama: FakeLlamaServer) -> AsyncIterator[StartServer]:
    """Start a real server on 127.0.0.1:0 (against the fake unless told otherwise)."""
    started: list[RunningServer] = []

    async def start(**overrides: Any) -> RunningServer:
        # No probe: it would add two scored pairs to what the fake records.
        base = Settings(
            port=0,
            backend_url=fake_llama.url,
            grace_period_s=1.0,
            probe=False,
            http_port=0,
            metrics_port=0,
        )
        running = await build_server(dataclasses.replace(base, **overrides))
        started.append(running)
        return running

    yield start
    for running in started:
        await running.stop(grace=0)


@pytest.fixture
async def server(start_server: StartServer) -> RunningServer:
    return await start_server()


@pytest.fixture
async def client(server: RunningServer) -> AsyncIterator[AsyncRerankClient]:
    async with client_of(server) as c:
        yield c


@pytest.fixture
def frozen_heap() -> Iterator[None]:
    """The test process's heap beyond the cyclic collector for one test, as a server's
    startup objects are in production (`server.freeze_startup_objects`).

    An in-process server shares pytest's heap: late in a full run a full collection walks
    about 170,000 objects and stops the event loop for 200-350 ms on the 2-core CI
    machine, which a test that times answers to a quarter of a second then reads as the
    server's delay (seen once in `test_hung_backend`)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A real redis-server on loopback (tests/fakes/redis_server.py), stopped after."""
    server = RedisServer().start()
    yield server
    server.stop()
