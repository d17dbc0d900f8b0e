"""A lean HTTP/1.1 transport under httpx for plain-HTTP backends.

httpx stays the client API (requests, responses, timeouts, error types); this replaces
what sits under it for `http://` URLs. `HttpBackend` hands its `httpx.Request`s to it
directly, without an `httpx.AsyncClient` in between (`backend.py`). httpcore's
general-purpose pool (anyio streams, h11, a socket-readability check on every request)
was most of the server's CPU per scored pair (docs/decisions.md, "Plain-HTTP backend
calls go through a lean transport, as bytes"). Model servers on the same host or pod speak a narrow
HTTP/1.1: one request per connection at a time, `Content-Length` or chunked bodies,
keep-alive. That fits in an asyncio protocol that hands whole responses over, with one
timer per request.

- Connections are kept alive per host and port and reused most recent first; one the
  server closed while idle is dropped as soon as the event loop sees the close, so no
  readability check is needed before reuse, and one idle for `MAX_IDLE_S` is not reused,
  so that a request rarely meets a server closing it on its keep-alive timeout (5 s in
  cpp-httplib, which llama-server uses, and in uvicorn). A request on a reused connection
  that the server closed before sending any byte is retried once, on a new connection,
  within what is left of its read timeout (the keep-alive race). The server may have read
  it before closing, so it can see the request twice: the scoring calls this transport
  carries have no side effects. Anything else is not retried here.
- Answers are read strictly (RFC 9112): one `Content-Length` value, no transfer coding
  but `chunked`, chunk sizes in plain hex that match their data, size and trailer lines
  no longer than a head; a close-delimited body ended by a reset is an error, not the
  body. A folded header line is joined to the one before.
- Timeouts (httpx's `Timeout`, per request): `connect` bounds the connection, `read` the
  whole response (not each read, as in httpx's own transport); they raise httpx's
  `ConnectTimeout` and `ReadTimeout`. A refused or reset connection is `ConnectError` /
  `ReadError`, a malformed answer
  `RemoteProtocolError`: the same classes httpx's own transport raises, so failure
  handling above (`backend.py`) is unchanged.
- A request cancelled mid-flight closes its connection (its answer would arrive on it).
- As an httpx transport (`handle_async_request`) the body is handed to `httpx.Response`
  whole, which decodes a `Content-Encoding`.
- `send` is the same exchange without httpx's request and response objects: the caller
  brings the request head as bytes (`HttpBackend` keeps one per path and adds the length)
  and gets the status, headers and body back (`Answer`; `content` decodes an encoded
  body). Building and reading those two objects was a large share of a per-pair backend
  call's CPU.

`https://` URLs, and any when a proxy is configured in the environment, keep httpx's own
transport (`new_client` in `backend.py` chooses).
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import zlib
from collections import defaultdict
from collections.abc import Mapping
from typing import NamedTuple, cast
from urllib.parse import urlsplit

import httpx

from .wakeup import Wakeup

MAX_HEAD_BYTES = 64 * 1024  # status line and headers; also a chunk-size or trailer line
# Under the servers' keep-alive timeouts (5 s), so an idle connection is given up before
# they close it rather than just as a request goes out on it.
MAX_IDLE_S = 4.0
# The largest answer read (after decoding, for an encoded one): an embeddings answer for
# 100 documents of 4,096 floats as text is about 8 MB. Far more would let a broken or
# hostile backend cost gigabytes of memory and seconds of event loop per call.
MAX_BODY_BYTES = 32 * 1024 * 1024
# Anything a connection holds beyond one whole answer is not an answer.
_MAX_BUFFERED = MAX_BODY_BYTES + MAX_HEAD_BYTES
_NO_BODY = frozenset({204, 304})
_HEX_DIGITS = b"0123456789abcdefABCDEF"


class _Connection(asyncio.Protocol):
    """One TCP connection: bytes in, a reader woken on data or close (`wakeup`), and on
    the answer's read timeout (`wakeup.expire`)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.busy = True  # an exchange is on it; False while it waits in the idle pool
        self.overrun = False  # closed by us for holding more than an answer can be
        self.closed = False
        self.error: BaseException | None = None
        self.wakeup = Wakeup()
        self.idle_since = 0.0  # event-loop time it was put back in the idle pool

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if not self.busy or len(self.buffer) + len(data) > _MAX_BUFFERED:
            # Bytes on an idle connection answer nothing, and more than an answer can
            # be is not one: the connection is done, before a server that keeps writing
            # can grow this buffer without bound.
            self.overrun = True
            self.close()
            self.wakeup.wake()
            return
        self.buffer += data
        self.wakeup.wake()

    def eof_received(self) -> bool:
        self.closed = True
        self.wakeup.wake()
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.error = exc
        self.wakeup.wake()

    async def more(self) -> None:
        """Wait until more bytes arrive or the connection closes; TimeoutError once the
        read timeout has run out."""
        await self.wakeup.wait()
        if self.wakeup.expired:
            raise TimeoutError

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class Answer(NamedTuple):
    """A whole HTTP answer, as `LeanTransport.send` reads it."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes  # as sent: still encoded if `Content-Encoding` says so

    def content(self) -> bytes:
        """The body, decoded where a `Content-Encoding` other than identity says so."""
        return decoded(self.headers, self.body)


def decoded(headers: list[tuple[bytes, bytes]], body: bytes, limit: int = MAX_BODY_BYTES) -> bytes:
    """`body` without its `Content-Encoding` (gzip or deflate), at most `limit` bytes of
    it; httpx.DecodingError for another coding, bad data, or more than that. We never ask
    for an encoding, but a server (or a proxy before it) may use one anyway, and httpx's
    own decoder has no bound: a small compressed answer can inflate a thousandfold."""
    encoding = _header(headers, b"content-encoding").strip().lower()
    if not encoding or encoding == b"identity":
        return body
    if encoding not in (b"gzip", b"x-gzip", b"deflate"):
        raise httpx.DecodingError(f"unsupported Content-Encoding {encoding[:32]!r}")
    # gzip or zlib by their headers (32 + 15); raw deflate, which some servers send as
    # `deflate`, on a second try.
    for wbits in (47, -15):
        inflater = zlib.decompressobj(wbits)
        try:
            out = inflater.decompress(body, limit + 1)
        except zlib.error:
            continue
        if len(out) > limit or inflater.unconsumed_tail:
            raise httpx.DecodingError("response body too large once decoded")
        if inflater.eof:
            return out
    raise httpx.DecodingError(f"invalid {encoding.decode(errors='replace')} data")


class _Unanswered(Exception):
    """The server closed a reused connection before sending a byte (keep-alive race)."""


class LeanTransport(httpx.AsyncBaseTransport):
    """HTTP/1.1 over keep-alive asyncio connections; `max_idle` kept per host and port."""

    def __init__(self, max_idle: int = 8) -> None:
        self._max_idle = max_idle
        self._idle: defaultdict[tuple[str, int], list[_Connection]] = defaultdict(list)
        self._closed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeout: dict[str, float | None] = request.extensions.get("timeout", {})
        url = request.url
        body = await request.aread()
        head = request_head(request)
        if "transfer-encoding" in request.headers:  # a streamed body, read whole: framed by
            head = request_head(
                request, omit=b"transfer-encoding"
            ) + b"Content-Length: %d\r\n" % len(body)  # length, not chunks
        answer = await self.send(
            url.host,
            url.port or 80,
            head + b"\r\n" + body,
            timeout.get("connect"),
            timeout.get("read"),
            head_only=request.method == "HEAD",
            request=request,
        )
        return httpx.Response(
            answer.status,
            headers=answer.headers,
            content=answer.body,
            request=request,
            extensions={"http_version": b"HTTP/1.1"},
        )

    async def send(
        self,
        host: str,
        port: int,
        data: bytes,
        connect_s: float | None,
        read_s: float | None,
        *,
        head_only: bool = False,
        request: httpx.Request | None = None,
    ) -> Answer:
        """Send `data` (a whole request: head and body) to `host:port` and read the
        answer; raises httpx's transport errors (naming `request` where there is one)."""
        if self._closed:
            raise httpx.ConnectError("the transport is closed", request=request)
        key = (host, port)
        loop = asyncio.get_running_loop()
        connection, reused = await self._connection(key, connect_s, request, loop)
        sent = loop.time()
        try:
            return await self._exchange(
                key, connection, reused, data, head_only, request, read_s, loop
            )
        except _Unanswered:
            pass
        # The keep-alive race: once more, on a new connection, in the time that is left.
        left = None if read_s is None else read_s - (loop.time() - sent)
        if left is not None and left <= 0:
            raise httpx.ReadTimeout("no complete answer within the read timeout", request=request)
        connection, _ = await self._connection(key, connect_s, request, loop, fresh=True)
        return await self._exchange(key, connection, False, data, head_only, request, left, loop)

    async def _connection(
        self,
        key: tuple[str, int],
        connect_s: float | None,
        request: httpx.Request | None,
        loop: asyncio.AbstractEventLoop,
        fresh: bool = False,
    ) -> tuple[_Connection, bool]:
        idle = self._idle[key]
        while idle and not fresh:
            connection = idle.pop()
            if (
                not connection.closed
                and not connection.buffer
                and loop.time() - connection.idle_since < MAX_IDLE_S
            ):
                connection.busy = True
                return connection, True
            connection.close()  # closed, idle too long, or holding bytes nobody asked for
        try:
            async with asyncio.timeout(connect_s):
                _, connection = await loop.create_connection(_Connection, key[0], key[1])
        except TimeoutError:
            raise httpx.ConnectTimeout("connect timed out", request=request) from None
        except OSError as exc:
            raise httpx.ConnectError(str(exc) or type(exc).__name__, request=request) from None
        return connection, False

    async def _exchange(
        self,
        key: tuple[str, int],
        connection: _Connection,
        reused: bool,
        data: bytes,
        head_only: bool,
        request: httpx.Request | None,
        read_s: float | None,
        loop: asyncio.AbstractEventLoop,
    ) -> Answer:
        assert connection.transport is not None
        connection.transport.write(data)
        # One timer that wakes the reader (`Wakeup.expire`): `asyncio.timeout` costs a
        # context manager and a task's cancellation bookkeeping per call besides.
        timer = None if read_s is None else loop.call_later(read_s, connection.wakeup.expire)
        done = False
        try:
            status, headers, keep_alive = await _read_head(connection, reused, request)
            while 100 <= status < 200:  # interim answers (100 Continue, 103): skip
                status, headers, keep_alive = await _read_head(connection, False, request)
            content = (
                b""
                if status in _NO_BODY or head_only
                else await _read_body(connection, headers, request)
            )
            done = True
        except TimeoutError:
            raise httpx.ReadTimeout(
                "no complete answer within the read timeout", request=request
            ) from None
        finally:
            if timer is not None:
                timer.cancel()
            if not done:
                connection.close()  # mid-answer: its bytes would confuse the next request
        idle = self._idle[key]
        if (
            keep_alive
            and not connection.closed
            and not connection.buffer
            and not self._closed
            and len(idle) < self._max_idle
        ):
            connection.idle_since = loop.time()
            connection.busy = False
            idle.append(connection)
        else:
            connection.close()
        return Answer(status, headers, content)

    async def aclose(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for connection in idle:
                connection.close()
        self._idle.clear()


def request_head(request: httpx.Request, omit: bytes = b"") -> bytes:
    """`request`'s request line and header lines, each ending in CRLF, without the empty
    line that ends the head; the header named `omit` (lowercase) is left out."""
    target = request.url.raw_path  # path and query, already encoded
    lines = [request.method.encode() + b" " + target + b" HTTP/1.1"]
    lines.extend(
        name + b": " + value for name, value in request.headers.raw if name.lower() != omit
    )
    return b"\r\n".join(lines) + b"\r\n"


async def _read_head(
    connection: _Connection,
    reused: bool,
    request: httpx.Request | None,
) -> tuple[int, list[tuple[bytes, bytes]], bool]:
    buffer = connection.buffer
    while (end := buffer.find(b"\r\n\r\n")) < 0:
        if len(buffer) > MAX_HEAD_BYTES:
            raise httpx.RemoteProtocolError("response head too large", request=request)
        if connection.closed:
            _disconnected(connection, reused, request)
        await connection.more()
    lines = bytes(buffer[:end]).split(b"\r\n")
    del buffer[: end + 4]
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise httpx.RemoteProtocolError("malformed status line", request=request)
    headers: list[tuple[bytes, bytes]] = []
    for line in lines[1:]:
        if line[:1] in (b" ", b"\t") and headers:  # obs-fold: continues the last value
            name, value = headers[-1]
            headers[-1] = (name, value + b" " + line.strip())
            continue
        name, sep, value = line.partition(b":")
        if not sep:
            raise httpx.RemoteProtocolError("malformed header line", request=request)
        headers.append((name.strip(), value.strip()))
    connection_header = _header(headers, b"connection").lower()
    keep_alive = b"close" not in connection_header and (
        parts[0] == b"HTTP/1.1" or b"keep-alive" in connection_header
    )
    return int(parts[1]), headers, keep_alive


def _disconnected(
    connection: _Connection,
    reused: bool,
    request: httpx.Request | None,
) -> None:
    """Raise for a connection that closed before the answer was complete."""
    if reused and connection.error is None and not connection.buffer:
        raise _Unanswered
    if isinstance(connection.error, OSError):
        raise httpx.ReadError(
            str(connection.error) or type(connection.error).__name__, request=request
        )
    raise httpx.RemoteProtocolError(
        "server disconnected before the answer was complete", request=request
    )


async def _read_body(
    connection: _Connection, headers: list[tuple[bytes, bytes]], request: httpx.Request | None
) -> bytes:
    coding = _header(headers, b"transfer-encoding")
    if coding:
        # Only plain chunked: a coding before it (`gzip, chunked`) would reach the caller
        # still applied; model servers send none.
        if coding.strip().lower() != b"chunked":
            raise httpx.RemoteProtocolError("unsupported Transfer-Encoding", request=request)
        return await _read_chunked(connection, request)
    length = _content_length(headers, request)
    if length is not None:
        return await _read_exactly(connection, length, request)
    while not connection.closed:  # no length: the body ends with the connection
        if len(connection.buffer) > MAX_BODY_BYTES:
            raise httpx.RemoteProtocolError("response body too large", request=request)
        await connection.more()
    if isinstance(connection.error, OSError):  # a reset, not the end of the body
        raise httpx.ReadError(
            str(connection.error) or type(connection.error).__name__, request=request
        )
    if connection.overrun:  # our own close, not the end of the body
        raise httpx.RemoteProtocolError("response body too large", request=request)
    content = bytes(connection.buffer)
    connection.buffer.clear()
    return content


async def _read_exactly(
    connection: _Connection,
    n: int,
    request: httpx.Request | None,
) -> bytes:
    buffer = connection.buffer
    while len(buffer) < n:
        if connection.closed:
            _disconnected(connection, False, request)
        await connection.more()
    content = bytes(buffer[:n])
    del buffer[:n]
    return content


async def _read_chunked(connection: _Connection, request: httpx.Request | None) -> bytes:
    parts: list[bytes] = []
    total = 0
    while True:
        size_field = (await _read_line(connection, request)).split(b";", 1)[0].strip()
        if not size_field or size_field.strip(_HEX_DIGITS):  # int() would take -3, 0x5, 1_0
            raise httpx.RemoteProtocolError("malformed chunk size", request=request)
        size = int(size_field, 16)
        total += size
        if total > MAX_BODY_BYTES:
            raise httpx.RemoteProtocolError("response body too large", request=request)
        if size == 0:
            # Trailer lines (rare), then the empty line that ends the body.
            while await _read_line(connection, request):
                pass
            return b"".join(parts)
        chunk = await _read_exactly(connection, size + 2, request)
        if chunk[-2:] != b"\r\n":  # the size and the data disagree
            raise httpx.RemoteProtocolError("malformed chunk", request=request)
        parts.append(chunk[:-2])


async def _read_line(connection: _Connection, request: httpx.Request | None) -> bytes:
    """One CRLF-ended line of a chunked body (a size, or a trailer), without the CRLF."""
    buffer = connection.buffer
    while (end := buffer.find(b"\r\n")) < 0:
        if len(buffer) > MAX_HEAD_BYTES:
            raise httpx.RemoteProtocolError("chunk-size or trailer line too long", request=request)
        if connection.closed:
            _disconnected(connection, False, request)
        await connection.more()
    line = bytes(buffer[:end])
    del buffer[: end + 2]
    return line


def _content_length(
    headers: list[tuple[bytes, bytes]],
    request: httpx.Request | None,
) -> int | None:
    """The body's length, None when no header gives it; one value however many times
    it is sent (`5, 5` too), or the answer is malformed."""
    values = {
        v.strip()
        for key, value in headers
        if key.lower() == b"content-length"
        for v in value.split(b",")
    }
    if not values:
        return None
    value = values.pop()
    if values or not value.isdigit() or int(value) > MAX_BODY_BYTES:
        raise httpx.RemoteProtocolError("bad Content-Length", request=request)
    return int(value)


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes:
    for key, value in headers:
        if key.lower() == name:
            return value
    return b""


def wanted(base_url: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether `base_url` gets this transport: plain HTTP with no proxy configured, or
    to loopback, which no proxy can be meant for (`loopback`)."""
    env = os.environ if environ is None else environ
    proxied = any(env.get(name) for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"))
    return base_url.startswith("http://") and (not proxied or loopback(base_url))


def loopback(base_url: str) -> bool:
    """Whether `base_url` is on this machine's loopback: a proxy elsewhere cannot reach
    it, so a proxy in the environment (HTTP_PROXY, set for the model downloads, say)
    must not be used for it; httpx would, unless NO_PROXY named it."""
    host = (urlsplit(base_url).hostname or "").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
