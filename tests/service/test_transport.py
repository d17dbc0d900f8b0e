"""The lean HTTP/1.1 transport (`scoring/transport/lean.py`) against raw loopback servers
that answer exactly as scripted: the framings, keep-alive and its races, and every failure
mapped to the httpx error class that `scoring/transport/backend.py` classifies."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest

from rerank_server.scoring.base import Failure
from rerank_server.scoring.transport import backend as http_module
from rerank_server.scoring.transport import lean
from rerank_server.scoring.transport.backend import HttpBackend
from rerank_server.scoring.transport.errors import BackendCallError
from rerank_server.scoring.transport.lean import LeanTransport, wanted
from tests.conftest import StartServer, client_of
from tests.fakes.llama import FakeLlamaServer

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


class RawServer:
    """Calls `handler(reader, writer, n)` for the n-th request head on each connection."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.bodies: list[bytes] = []  # every request body, in the order read
        self.hung_up = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.append(writer)
        n = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    0,
                )
                self.bodies.append(await reader.readexactly(length))
                await self.handler(reader, writer, n)
                n += 1
                if writer.is_closing():
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            self.hung_up.set()
        finally:
            writer.close()

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.close()
        await self._server.wait_closed()


@pytest.fixture
async def raw() -> AsyncIterator[Callable[[Handler], Awaitable[str]]]:
    servers: list[RawServer] = []

    async def start(handler: Handler) -> str:
        server = RawServer(handler)
        servers.append(server)
        return await server.start()

    yield start
    for server in servers:
        await server.stop()


def _answer(body: bytes, *headers: str) -> bytes:
    head = ["HTTP/1.1 200 OK", f"Content-Length: {len(body)}", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def _post(
    url: str, transport: LeanTransport | None = None, timeout: float = 5.0
) -> httpx.Response:
    async with httpx.AsyncClient(transport=transport or LeanTransport(), timeout=timeout) as c:
        return await c.post(url + "/v1/x", json={"q": 1})


async def test_content_length_chunked_gzip_and_close_delimited_bodies(
    raw: Callable[[Handler], Awaitable[str]],
) -> None:
    payload = json.dumps({"ok": [1, 2, 3]}).encode()

    async def chunked(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _n: int) -> None:
        w.write(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (payload[:5], payload[5:]))
            + b"0\r\nX-Trailer: 1\r\n\r\n"
        )

    async def gzipped(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _n: int) -> None:
        w.write(_answer(gzip.compress(payload), "Content-Encoding: gzip"))

    async def until_close(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _n: int) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + payload)
        w.close()

    async def interim_first(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _n: int) -> None:
        w.write(b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n" + _answer(payload))

    for handler in (chunked, gzipped, until_close, interim_first):
        response = await _post(await raw(handler))
        assert response.status_code == 200 and response.json() == {"ok": [1, 2, 3]}


async def test_keep_alive_reuses_one_connection_and_survives_a_server_closing_it(
    raw: Callable[[Handler], Awaitable[str]],
) -> None:
    async def answer(_r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        w.write(_answer(b'{"n": %d}' % n))
        if n == 2:
            # The server drops the idle connection after its third answer, the way
            # keep-alive timeouts do: the next request must go out on a fresh one.
            await w.drain()
            w.close()

    url = await raw(answer)
    transport = LeanTransport()
    async with httpx.AsyncClient(transport=transport, timeout=5) as client:
        seen = [(await client.post(url, json={})).json()["n"] for _ in range(5)]
    assert seen == [0, 1, 2, 0, 1]


async def test_a_reused_connection_closed_before_answering_is_retried_once(
    raw: Callable[[Handler], Awaitable[str]],
) -> None:
    """The keep-alive race: the server closes just as the next request goes out."""

    async def answer(_r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        if n == 1:
            w.close()  # reads the second request, then hangs up without a byte
            return
        w.write(_answer(b'{"ok": true}'))

    url = await raw(answer)
    async with httpx.AsyncClient(transport=LeanTransport(), timeout=5) as client:
        assert (await client.post(url, json={})).json() == {"ok": True}
        assert (await client.post(url, json={})).json() == {"ok": True}


async def test_the_retry_goes_out_on_a_new_connection() -> None:
    """With two idle connections that the server hangs up on, the retry does not take
    the second one (it would fail the same way): it opens a new one."""

    async def answer(_r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        if n == 1:
            w.close()
            return
        await asyncio.sleep(0.05)  # both first requests in flight at once: two connections
        w.write(_answer(b'{"ok": true}'))

    server = RawServer(answer)
    url = await server.start()
    async with httpx.AsyncClient(transport=LeanTransport(), timeout=5) as client:
        await asyncio.gather(client.post(url, json={}), client.post(url, json={}))
        assert server.connections == 2
        assert (await client.post(url, json={"third": 1})).json() == {"ok": True}
    await server.stop()
    assert server.connections == 3
    assert server.bodies.count(b'{"third":1}') == 2  # read, hung up on, sent again


async def test_the_retry_has_only_what_is_left_of_the_read_timeout() -> None:
    """A server that holds the request, then hangs up: the retry does not start the read
    timeout again, so the call ends within it."""

    async def answer(_r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        if n == 1 or server.connections > 1:
            await asyncio.sleep(0.6)
        if n == 1:
            w.close()
            return
        w.write(_answer(b'{"ok": true}'))

    server = RawServer(answer)
    url = await server.start()
    loop = asyncio.get_running_loop()
    async with httpx.AsyncClient(
        transport=LeanTransport(), timeout=httpx.Timeout(5, read=1.0)
    ) as client:
        await client.post(url, json={})
        started = loop.time()
        with pytest.raises(httpx.ReadTimeout):
            await client.post(url, json={})  # 0.6 s, hung up on; 0.6 s more on a new one
        assert loop.time() - started < 1.5
    await server.stop()


async def test_a_connection_idle_too_long_is_not_reused(
    raw: Callable[[Handler], Awaitable[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given up before the server's keep-alive timeout could close it under a request."""
    monkeypatch.setattr(lean, "MAX_IDLE_S", 0.2)

    async def answer(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _n: int) -> None:
        w.write(_answer(b'{"ok": true}'))

    server = RawServer(answer)
    url = await server.start()
    async with httpx.AsyncClient(transport=LeanTransport(), timeout=5) as client:
        await client.post(url, json={})
        await client.post(url, json={})
        assert server.connections == 1
        await asyncio.sleep(0.3)
        await client.post(url, json={})
    await server.stop()
    assert server.connections == 2


CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


@pytest.mark.parametrize(
    "reply,error",
    [
        (b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"half', httpx.RemoteProtocolError),
        (b"garbage\r\n\r\n", httpx.RemoteProtocolError),
        (b"", httpx.RemoteProtocolError),  # a fresh connection closed without a byte
        # Two lengths: which one frames the body is anyone's guess (RFC 9112 6.3).
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 5\r\n\r\nhello",
            httpx.RemoteProtocolError,
        ),
        # A coding under the chunks would reach the caller still applied.
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
            httpx.RemoteProtocolError,
        ),
        # Chunk sizes int() would take: a negative one undercounts the body's size.
        (CHUNKED + b"5\r\nhello\r\n-0\r\n\r\n", httpx.RemoteProtocolError),
        (CHUNKED + b"0x5\r\nhello\r\n0\r\n\r\n", httpx.RemoteProtocolError),
        (CHUNKED + b"1_0\r\n" + b"a" * 16 + b"\r\n0\r\n\r\n", httpx.RemoteProtocolError),
        # A size one short of the data: not "hell".
        (CHUNKED + b"4\r\nhello\r\n0\r\n\r\n", httpx.RemoteProtocolError),
    ],
)
async def test_broken_answers_are_transport_errors(
    raw: Callable[[Handler], Awaitable[str]], reply: bytes, error: type[Exception]
) -> None:
    async def answer(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _n: int) -> None:
        w.write(reply)
        await w.drain()
        w.close()

    with pytest.raises(error):
        await _post(await raw(answer))


async def test_a_chunk_size_line_is_not_buffered_without_bound(
    raw: Callable[[Handler], Awaitable[str]],
) -> None:
    """A size line that never ends fails once it is longer than a head may be, not
    when the read timeout runs out."""

    async def endless(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _n: int) -> None:
        w.write(CHUNKED + b"f" * (lean.MAX_HEAD_BYTES + 1024))
        await asyncio.sleep(30)

    with pytest.raises(httpx.RemoteProtocolError, match="too long"):
        await _post(await raw(endless), timeout=10)


async def test_a_body_ended_by_a_reset_is_not_taken_whole(
    raw: Callable[[Handler], Awaitable[str]],
) -> None:
    """A close-delimited body ends with the connection, but not with a reset."""

    async def reset(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _n: int) -> None:
        w.write(b'HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n{"scores": [0.1, 0.')
        await w.drain()
        await asyncio.sleep(0.1)
        # Linger 0: the close sends RST, as a server's crash or a middlebox can.
        w.get_extra_info("socket").setsockopt(
            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
        )
        w.transport.abort()

    with pytest.raises(httpx.ReadError):
        await _post(await raw(reset))


async def test_a_folded_header_is_read_as_one_value(
    raw: Callable[[Handler], Awaitable[str]],
) -> None:
    async def folded(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _n: int) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nX-Note: one\r\n \ttwo\r\nContent-Length: 2\r\n\r\n{}")

    response = await _post(await raw(folded))
    assert response.headers["x-note"] == "one two" and response.json() == {}


async def test_a_streamed_request_body_is_sent_with_its_length() -> None:
    """httpx marks a body from an iterator `Transfer-Encoding: chunked`; the transport
    reads it whole, so it must say how long it is instead of claiming chunks."""

    async def answer(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _n: int) -> None:
        w.write(_answer(b"{}"))

    async def parts() -> AsyncIterator[bytes]:
        yield b'{"a": '
        yield b"1}"

    server = RawServer(answer)
    url = await server.start()
    async with httpx.AsyncClient(transport=LeanTransport(), timeout=5) as client:
        assert (await client.post(url, content=parts())).json() == {}
        assert (await client.post(url, json={})).json() == {}  # the connection still in step
    await server.stop()
    assert server.bodies == [b'{"a": 1}', b"{}"] and server.connections == 1


async def test_read_timeout_and_refused_connection() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # never answers; returns when the client hangs up
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    with pytest.raises(httpx.ReadTimeout):
        await _post(f"http://127.0.0.1:{port}", timeout=0.3)
    server.close()
    await server.wait_closed()
    await asyncio.sleep(0.1)  # the silent handler sees its connection close
    with pytest.raises(httpx.ConnectError):
        await _post(f"http://127.0.0.1:{port}")


async def test_a_cancelled_request_hangs_up_its_connection(
    raw: Callable[[Handler], Awaitable[str]],
) -> None:
    async def slow(r: asyncio.StreamReader, _w: asyncio.StreamWriter, _n: int) -> None:
        await r.read()  # no answer; returns when the client hangs up
        started.hung_up.set()

    started = RawServer(slow)
    url = await started.start()
    task = asyncio.ensure_future(_post(url))
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # The server sees the hang-up (llama-server then frees the slot).
    await asyncio.wait_for(started.hung_up.wait(), 5)
    await started.stop()


async def test_failures_keep_their_classification_through_http_backend(
    raw: Callable[[Handler], Awaitable[str]],
) -> None:
    async def reset(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _n: int) -> None:
        w.transport.abort()

    backend = HttpBackend(await raw(reset), 2, 5.0)
    with pytest.raises(BackendCallError) as caught:
        await backend.post_json("/x", {})
    await backend.aclose()
    assert caught.value.failure is Failure.UNAVAILABLE


def test_plain_http_without_a_proxy_only() -> None:
    assert wanted("http://127.0.0.1:8080", {})
    assert not wanted("https://api.example.com", {})
    assert not wanted("http://llama:8080", {"HTTP_PROXY": "http://proxy:3128"})
    # no proxy can reach our loopback: one in the environment is not for it
    assert wanted("http://127.0.0.1:8080", {"HTTP_PROXY": "http://proxy:3128"})
    assert wanted("http://localhost:8080", {"ALL_PROXY": "http://proxy:3128"})


async def test_a_proxy_in_the_environment_is_not_used_for_a_loopback_backend(
    start_server: StartServer, fake_llama: FakeLlamaServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HTTP_PROXY set for the downloads (say) sent the calls and health polls for a
    backend on 127.0.0.1 to the proxy: every answer degraded. (Upper case only: gRPC's
    own client, the test's, reads the lower-case name.)"""
    with socket.socket() as dead:
        dead.bind(("127.0.0.1", 0))
        monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{dead.getsockname()[1]}")
        monkeypatch.setenv("ALL_PROXY", f"http://127.0.0.1:{dead.getsockname()[1]}")
        running = await start_server()
        async with client_of(running) as client:
            answer = await client.rerank("q", ["a", "b", "c"], timeout=10)
    assert answer.reranked


async def test_http_backend_sends_what_a_model_server_expects(
    raw: Callable[[Handler], Awaitable[str]],
) -> None:
    """`HttpBackend` hands its requests to the transport itself (no httpx client in
    between): the head still carries Host, the length, the JSON type and who we are, and
    the body is the payload as UTF-8 JSON, text left as it is."""
    seen: list[bytes] = []

    class Capturing(RawServer):
        async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            seen.extend([head, await reader.readexactly(length)])
            writer.write(_answer(b'{"ok": true}'))
            await writer.drain()
            writer.close()

    server = Capturing(lambda _r, _w, _n: asyncio.sleep(0))
    url = await server.start()
    backend = HttpBackend(url, 2, 5.0)
    payload = {"query": "café ü", "documents": ['naïve "quoted"'], "n": 1}
    assert await backend.post_json("/v1/rerank", payload) == {"ok": True}
    await backend.aclose()
    await server.stop()
    head, body = seen
    lines = head.decode().split("\r\n")
    assert lines[0] == "POST /v1/rerank HTTP/1.1"
    fields = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:] if x)}
    assert fields["host"] == url.removeprefix("http://")
    assert fields["content-type"] == "application/json"
    assert fields["user-agent"].startswith("rerank-server/")
    assert int(fields["content-length"]) == len(body)
    assert json.loads(body.decode("utf-8")) == payload
    assert "café".encode() in body  # UTF-8, not \u escapes


async def test_http_backend_times_out_a_backend_that_never_answers(
    raw: Callable[[Handler], Awaitable[str]],
) -> None:
    async def silent(_r: asyncio.StreamReader, _w: asyncio.StreamWriter, _n: int) -> None:
        await asyncio.sleep(30)

    backend = HttpBackend(await raw(silent), 2, 0.3)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(BackendCallError) as caught:
        await backend.post_json("/x", {})
    elapsed = loop.time() - started
    await backend.aclose()
    assert caught.value.failure is Failure.TIMEOUT
    assert 0.25 < elapsed < 2.0


async def test_http_backend_decodes_an_encoded_answer(
    raw: Callable[[Handler], Awaitable[str]],
) -> None:
    """The head-as-bytes path reads the answer without `httpx.Response`, so a server that
    compresses anyway (we ask for identity) must still come back decoded."""

    async def gzipped(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _n: int) -> None:
        w.write(_answer(gzip.compress(b'{"ok": "gz"}'), "Content-Encoding: gzip"))
        await w.drain()

    backend = HttpBackend(await raw(gzipped), 2, 5.0)
    assert await backend.post_json("/x", {}) == {"ok": "gz"}
    await backend.aclose()


def test_http_backend_refuses_a_header_that_would_split_the_head() -> None:
    with pytest.raises(ValueError, match="authorization"):
        HttpBackend(
            "http://127.0.0.1:9", 1, 1.0, headers={"authorization": "Bearer k\r\nx-injected: 1"}
        )


async def test_bytes_on_an_idle_connection_close_it(
    raw: Callable[[Handler], Awaitable[str]],
) -> None:
    """A server that answers, then keeps writing on the kept-alive connection: the
    connection is closed at the first unasked-for byte. Its buffer grew by hundreds of MB
    a second, for as long as nothing took the connection from the idle pool."""
    flood = asyncio.Event()

    async def answer_then_flood(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _n: int) -> None:
        w.write(_answer(b'{"ok": true}'))
        await w.drain()
        await asyncio.sleep(0.1)  # idle in the pool by now
        with contextlib.suppress(ConnectionError):
            for _ in range(2000):
                w.write(b"x" * 65536)
                await w.drain()
        flood.set()

    url = await raw(answer_then_flood)
    transport = LeanTransport()
    host, port = url.removeprefix("http://").split(":")
    answer = await transport.send(
        host, int(port), b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", 5, 5
    )
    [connection] = transport._idle[(host, int(port))]
    await asyncio.wait_for(flood.wait(), 10)
    await transport.aclose()
    assert answer.status == 200
    assert connection.closed and len(connection.buffer) == 0


@pytest.mark.parametrize(
    ("encoding", "body", "detail"),
    [
        ("gzip", gzip.compress(b"0" * (40 << 20)), "too large once decoded"),  # 40 KB -> 40 MB
        ("gzip", b"not gzip at all", "invalid gzip data"),
        ("br", b"\x0b\x02\x80{}\x03", "unsupported Content-Encoding"),
    ],
)
async def test_an_encoded_answer_is_decoded_with_a_bound_or_refused(
    raw: Callable[[Handler], Awaitable[str]], encoding: str, body: bytes, detail: str
) -> None:
    """httpx decoded any gzip without a bound (600 KB became 600 MB and seconds of event
    loop), and bad gzip escaped as a DecodingError that crashed the scorer."""

    async def encoded(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _n: int) -> None:
        w.write(_answer(body, f"Content-Encoding: {encoding}"))
        await w.drain()

    backend = HttpBackend(await raw(encoded), 2, 5.0)
    with pytest.raises(BackendCallError) as caught:
        await backend.post_json("/x", {})
    await backend.aclose()
    assert caught.value.failure is Failure.MALFORMED
    assert detail in caught.value.detail


async def test_a_redirect_is_not_an_answer(raw: Callable[[Handler], Awaitable[str]]) -> None:
    async def redirect(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _n: int) -> None:
        body = b'{"results": []}'
        w.write(
            f"HTTP/1.1 302 Found\r\nLocation: /elsewhere\r\nContent-Length: "
            f"{len(body)}\r\n\r\n".encode()
            + body
        )
        await w.drain()

    backend = HttpBackend(await raw(redirect), 2, 5.0)
    with pytest.raises(BackendCallError) as caught:
        await backend.post_json("/x", {})
    await backend.aclose()
    assert caught.value.failure is Failure.HTTP_ERROR and caught.value.detail == "HTTP 302"


async def test_health_and_metadata_gets_are_bounded_in_time_and_size(
    raw: Callable[[Handler], Awaitable[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `/health` whose body comes a byte at a time held the monitor's poll (and with
    it every instance's health) for good: httpx's timeout bounds each read, not the
    whole. Now each is read within HEALTH_TIMEOUT_S as a whole, and a metadata answer
    up to SIDE_MAX_BYTES."""
    monkeypatch.setattr(http_module, "HEALTH_TIMEOUT_S", 0.5)

    async def dribble(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _n: int) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
        with contextlib.suppress(ConnectionError):
            for _ in range(1000):
                w.write(b" ")
                await w.drain()
                await asyncio.sleep(0.1)

    async def huge(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _n: int) -> None:
        w.write(_answer(b'{"data": [{"id": "' + b"m" * (2 << 20) + b'"}]}'))
        await w.drain()

    slow = HttpBackend(await raw(dribble), 2, 5.0)
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await slow.health() is False  # the whole answer, within the bound
    assert await slow.get_json("/props") is None
    elapsed = loop.time() - started

    async def gzipped(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _n: int) -> None:
        w.write(_answer(gzip.compress(b'{"status": "ok"}'), "Content-Encoding: gzip"))
        await w.drain()

    big = HttpBackend(await raw(huge), 2, 5.0)
    assert await big.get_json("/v1/models") is None
    zipped = HttpBackend(await raw(gzipped), 2, 5.0)
    assert await zipped.health() is True  # decoded within its bound, as it was
    await zipped.aclose()
    await slow.aclose()
    await big.aclose()
    assert elapsed < 2.0


async def test_side_requests_cut_short_leave_no_connection_behind(
    raw: Callable[[Handler], Awaitable[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A health poll, `/props` and `/v1/models` overlapping against a backend that has
    stopped answering, each cut short by its timeout: one cancelled while it waited for
    one of the side client's two connections left that connection counted as in use for
    good (within about four rounds), so once the backend answered again every health
    poll still failed and the instance stayed down until a restart."""
    monkeypatch.setattr(http_module, "HEALTH_TIMEOUT_S", 0.1)
    answering = asyncio.Event()

    async def hung_then_up(
        _r: asyncio.StreamReader,
        w: asyncio.StreamWriter,
        _n: int,
    ) -> None:
        await answering.wait()
        w.write(_answer(b'{"status": "ok"}'))
        await w.drain()

    backend = HttpBackend(await raw(hung_then_up), 2, 5.0)
    for _ in range(20):
        assert (
            await asyncio.gather(
                backend.health(), backend.get_json("/props"), backend.get_json("/v1/models")
            )
        ) == [False, None, None]
    answering.set()
    assert await backend.health() is True
    await backend.aclose()
