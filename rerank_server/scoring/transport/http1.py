"""Reading an HTTP/1.1 answer strictly (RFC 9112) off one connection, for the lean
transport (`lean.py`): the head, a sized, chunked or close-delimited body, decoding."""

from __future__ import annotations

import asyncio
import zlib
from typing import NamedTuple, cast

import httpx

from .wakeup import Wakeup

MAX_HEAD_BYTES = 64 * 1024  # status line and headers; also a chunk-size or trailer line
# The largest answer read (after decoding, for an encoded one): an embeddings answer for
# 100 documents of 4,096 floats as text is about 8 MB. Far more would let a broken or
# hostile backend cost gigabytes of memory and seconds of event loop per call.
MAX_BODY_BYTES = 32 * 1024 * 1024
# Anything a connection holds beyond one whole answer is not an answer.
_MAX_BUFFERED = MAX_BODY_BYTES + MAX_HEAD_BYTES
_HEX_DIGITS = b"0123456789abcdefABCDEF"


class Connection(asyncio.Protocol):
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
    encoding = header(headers, b"content-encoding").strip().lower()
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


class Unanswered(Exception):
    """The server closed a reused connection before sending a byte (keep-alive race)."""


async def read_head(
    connection: Connection,
    reused: bool,
    request: httpx.Request | None,
) -> tuple[int, list[tuple[bytes, bytes]], bool]:
    head = await _read_until(connection, b"\r\n\r\n", "response head too large", reused, request)
    lines = head.split(b"\r\n")
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
    connection_header = header(headers, b"connection").lower()
    keep_alive = b"close" not in connection_header and (
        parts[0] == b"HTTP/1.1" or b"keep-alive" in connection_header
    )
    return int(parts[1]), headers, keep_alive


def _disconnected(
    connection: Connection,
    reused: bool,
    request: httpx.Request | None,
) -> None:
    """Raise for a connection that closed before the answer was complete."""
    if reused and connection.error is None and not connection.buffer:
        raise Unanswered
    if isinstance(connection.error, OSError):
        raise httpx.ReadError(
            str(connection.error) or type(connection.error).__name__, request=request
        )
    raise httpx.RemoteProtocolError(
        "server disconnected before the answer was complete", request=request
    )


async def read_body(
    connection: Connection, headers: list[tuple[bytes, bytes]], request: httpx.Request | None
) -> bytes:
    coding = header(headers, b"transfer-encoding")
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
    connection: Connection,
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


async def _read_chunked(connection: Connection, request: httpx.Request | None) -> bytes:
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


async def _read_line(connection: Connection, request: httpx.Request | None) -> bytes:
    """One CRLF-ended line of a chunked body (a size, or a trailer), without the CRLF."""
    return await _read_until(
        connection, b"\r\n", "chunk-size or trailer line too long", False, request
    )


async def _read_until(
    connection: Connection,
    end_mark: bytes,
    too_long: str,
    reused: bool,
    request: httpx.Request | None,
) -> bytes:
    """The bytes before `end_mark` (taken off the buffer with it), at most a head's size."""
    buffer = connection.buffer
    while (end := buffer.find(end_mark)) < 0:
        if len(buffer) > MAX_HEAD_BYTES:
            raise httpx.RemoteProtocolError(too_long, request=request)
        if connection.closed:
            _disconnected(connection, reused, request)
        await connection.more()
    found = bytes(buffer[:end])
    del buffer[: end + len(end_mark)]
    return found


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


def header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes:
    for key, value in headers:
        if key.lower() == name:
            return value
    return b""
