"""The Python client's defaults against faults on real sockets: a connection reset under a
call (retried), a server that accepts and never answers (the default deadline), a token
about to go out in plaintext (a warning)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time
import warnings
from collections.abc import AsyncIterator

import pytest
from rerank_client import (
    AsyncRerankClient,
    DeadlineExceededError,
    InsecureTokenWarning,
    RerankClient,
    UnavailableError,
)
from rerank_client.client import is_local

from tests.conftest import StartServer, client_of
from tests.fakes.llama import FakeLlamaServer
from tests.waiting import eventually


class ResettingProxy:
    """Forwards TCP to `port`; `reset()` kills every open connection with an RST, as a
    node's failure or a middlebox can, while later connections are forwarded again."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.connections = 0
        self._open: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._forward, "127.0.0.1", 0)
        return f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)
        self._open |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError, OSError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.transport.abort()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._open -= {writer, up_writer}

    def reset(self) -> None:
        for writer in list(self._open):
            with contextlib.suppress(OSError):
                writer.get_extra_info("socket").setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )
            writer.transport.abort()
        self._open.clear()

    async def close(self) -> None:
        self.reset()
        if self._server is not None:
            self._server.close()


@pytest.fixture
async def proxy(start_server: StartServer) -> AsyncIterator[ResettingProxy]:
    running = await start_server()
    proxy = ResettingProxy(running.port)
    yield proxy
    await proxy.close()


async def _reset_while_scoring(
    proxy: ResettingProxy, fake: FakeLlamaServer, client: AsyncRerankClient
) -> asyncio.Task[object]:
    """Starts a call, and resets its connection once the backend is scoring it."""
    fake.latency_s = 0.3
    fake.received.clear()
    call = asyncio.ensure_future(client.rerank("q", ["a", "b", "c"]))
    assert await asyncio.to_thread(fake.received.wait, 10)
    proxy.reset()
    return call


async def test_a_call_whose_connection_resets_is_sent_again(
    proxy: ResettingProxy, fake_llama: FakeLlamaServer
) -> None:
    async with AsyncRerankClient(await proxy.start()) as client:
        call = await _reset_while_scoring(proxy, fake_llama, client)
        answer = await call
    assert answer.reranked and len(answer.results) == 3
    assert proxy.connections == 2  # the retry went out on a new connection


async def test_with_one_attempt_the_reset_reaches_the_caller(
    proxy: ResettingProxy, fake_llama: FakeLlamaServer
) -> None:
    async with AsyncRerankClient(await proxy.start(), retry_attempts=1) as client:
        call = await _reset_while_scoring(proxy, fake_llama, client)
        with pytest.raises(UnavailableError):
            await call


async def test_a_stream_reset_before_its_first_result_is_sent_again(
    proxy: ResettingProxy, fake_llama: FakeLlamaServer
) -> None:
    async with AsyncRerankClient(await proxy.start()) as client:
        fake_llama.latency_s = 0.3
        fake_llama.received.clear()

        async def read() -> list[object]:
            return [item async for item in client.stream("q", ["a", "b", "c"])]

        call = asyncio.ensure_future(read())
        assert await asyncio.to_thread(fake_llama.received.wait, 10)
        proxy.reset()
        items = await call
    assert len(items) == 4 and proxy.connections == 2  # 3 results, then the summary


@pytest.fixture
async def silent_port() -> AsyncIterator[int]:
    """Accepts connections and never answers: a hung process, or a black-holed path."""
    held: list[asyncio.StreamWriter] = []

    async def hold(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        held.append(w)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    for w in held:
        w.transport.abort()
    server.close()


async def test_the_default_deadline_ends_a_call_to_a_server_that_never_answers(
    silent_port: int,
) -> None:
    async with AsyncRerankClient(f"127.0.0.1:{silent_port}", default_timeout=0.5) as client:
        started = time.monotonic()
        with pytest.raises(DeadlineExceededError):
            await client.rerank("q", ["a"])
        assert time.monotonic() - started < 5
        # A call's own timeout still wins over the default.
        started = time.monotonic()
        with pytest.raises(DeadlineExceededError):
            await client.rerank("q", ["a"], timeout=0.1)
        assert time.monotonic() - started < 0.45


async def test_without_a_default_deadline_the_call_waits(silent_port: int) -> None:
    """What the default is for: the same call with none set is still waiting."""
    async with AsyncRerankClient(f"127.0.0.1:{silent_port}", default_timeout=None) as client:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(client.rerank("q", ["a"]), 1.0)


def test_a_token_for_a_remote_host_without_tls_warns() -> None:
    with pytest.warns(InsecureTokenWarning, match="10.0.0.7:50051 in plaintext"):
        RerankClient("10.0.0.7:50051", token="secret").close()
    with pytest.warns(InsecureTokenWarning):
        RerankClient("dns:///reranker.search.svc:50051", token="secret").close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RerankClient("127.0.0.1:50051", token="secret").close()  # loopback
        RerankClient("10.0.0.7:50051").close()  # no token to leak


@pytest.mark.parametrize(
    ("target", "local"),
    [
        ("127.0.0.1:50051", True),
        ("localhost:50051", True),
        ("[::1]:50051", True),
        ("ipv4:127.0.0.1:1,127.0.0.1:2", True),
        ("ipv4:127.0.0.1:1,10.0.0.5:2", False),
        ("ipv6:[::1]:1,[2001:db8::1]:2", False),
        ("dns:///localhost:50051", True),
        ("unix:/run/rerank.sock", True),
        ("localhost", True),
        ("::1", True),
        ("10.0.0.7:50051", False),
        ("dns:///reranker:50051", False),
        ("[2001:db8::1]:1", False),
        ("example.com", False),
    ],
)
def test_which_targets_are_local(target: str, local: bool) -> None:
    assert is_local(target) is local


def test_retry_attempts_and_default_timeout_are_checked() -> None:
    with pytest.raises(ValueError, match=r"retry_attempts must be 1\.\.5"):
        RerankClient("127.0.0.1:1", retry_attempts=6)
    with pytest.raises(ValueError, match="default_timeout must be > 0"):
        RerankClient("127.0.0.1:1", default_timeout=0)


async def test_leaving_rerank_many_early_cancels_the_rest_on_the_server(
    start_server: StartServer, fake_llama: FakeLlamaServer
) -> None:
    """The promise in docs/api.md: closed early (aclosing), the batch stream's call is
    cancelled, and the server stops working on requests nobody will read."""
    server = await start_server()
    fake_llama.latency_for = lambda doc: 0.0 if "fast" in doc else 5.0
    queries = {
        "first": ("q", ["fast a", "fast b", "fast c"]),
        **{f"slow {n}": ("q", [f"slow {n} a", f"slow {n} b", f"slow {n} c"]) for n in range(3)},
    }
    async with client_of(server) as client:
        async with contextlib.aclosing(client.rerank_many(queries)) as answers:
            async for request_id, _answer in answers:
                assert request_id == "first"
                assert server.reranker.active == 3  # the slow ones are being scored
                break
        assert await eventually(lambda: server.reranker.active == 0, 3), (
            "the slow requests ran on after the close"
        )
