"""A lean HTTP/1.1 transport under httpx for plain-HTTP backends: kept-alive connections,
strict answers, whole-response timeouts (docs/architecture.md, "Transport").
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
from collections import defaultdict
from collections.abc import Mapping
from urllib.parse import urlsplit

import httpx

from .http1 import (
    MAX_BODY_BYTES,
    MAX_HEAD_BYTES,
    Answer,
    Connection,
    Unanswered,
    decoded,
    read_body,
    read_head,
)

__all__ = [
    "MAX_BODY_BYTES",
    "MAX_HEAD_BYTES",
    "Answer",
    "LeanTransport",
    "decoded",
    "loopback",
    "request_head",
    "wanted",
]

# Under the servers' keep-alive timeouts (5 s), so an idle connection is given up before
# they close it rather than just as a request goes out on it.
MAX_IDLE_S = 4.0
_NO_BODY = frozenset({204, 304})


class LeanTransport(httpx.AsyncBaseTransport):
    """HTTP/1.1 over keep-alive asyncio connections; `max_idle` kept per host and port."""

    def __init__(self, max_idle: int = 8) -> None:
        self._max_idle = max_idle
        self._idle: defaultdict[tuple[str, int], list[Connection]] = defaultdict(list)
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
        except Unanswered:
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
    ) -> tuple[Connection, bool]:
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
                _, connection = await loop.create_connection(Connection, key[0], key[1])
        except TimeoutError:
            raise httpx.ConnectTimeout("connect timed out", request=request) from None
        except OSError as exc:
            raise httpx.ConnectError(str(exc) or type(exc).__name__, request=request) from None
        return connection, False

    async def _exchange(
        self,
        key: tuple[str, int],
        connection: Connection,
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
            status, headers, keep_alive = await read_head(connection, reused, request)
            while 100 <= status < 200:  # interim answers (100 Continue, 103): skip
                status, headers, keep_alive = await read_head(connection, False, request)
            content = (
                b""
                if status in _NO_BODY or head_only
                else await read_body(connection, headers, request)
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
