"""The JSON edge's server: uvicorn in this process and event loop, beside gRPC, with
bounds on connections, request heads and stalled answers (docs/architecture.md)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Iterator
from typing import Any, ClassVar

import structlog
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..errors import BindError
from ..security import timeouts
from ..security.tls import CertificateFiles
from ..settings import Settings, host_port

log = structlog.get_logger(__name__)

RELOAD_EVERY_S = 5.0
TICKS_PER_S = 10  # uvicorn's on_tick does its once-a-second work when counter % 10 == 0
HEAD_TIMEOUT_S = 10.0  # from connecting, or from the previous response, to a whole head
# A connection over the cap is answered 503 and read (its bytes dropped) this long before
# it is closed: closing with its request unread would reset it, and the client would see
# the reset instead of the 503 (as it does when a request's body is still arriving).
REFUSED_LINGER_S = 1.0
MAX_LINGERING = 64  # refused connections lingering at once, per server; past it: closed at once
TLS_SHUTDOWN_S = 5.0  # asyncio waits 30 s for a client's close_notify, the connection held
_TOO_MANY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Connection: close\r\nRetry-After: 1\r\nContent-Length: 46\r\n\r\n"
    b'{"message": "too many connections; try again"}'
)


class _BoundedH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request's head and a cap on the
    connections open at once (`max_connections`, set per server by `HttpEdge.start`)."""

    max_connections = 1024
    _head_timer: asyncio.TimerHandle | None = None
    _awaited_after: object = None  # the request cycle the head timer was started after
    _send_timer: asyncio.TimerHandle | None = None
    _refused: asyncio.TimerHandle | None = None  # over the cap: closes it when it fires
    lingering: ClassVar[set[_BoundedH11]] = set()  # refused, not yet closed; one per server

    def pause_writing(self) -> None:
        # The client is not taking the answer (the transport's buffer is full): it gets
        # timeouts.SEND_STALL_S to take some, or the connection goes, and with it the request's
        # place and bytes, which an app waiting to send would hold for ever.
        super().pause_writing()
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(timeouts.SEND_STALL_S, self._send_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _send_stalled(self) -> None:
        self._send_timer = None
        log.warning("http_send_stalled", waited_s=timeouts.SEND_STALL_S)
        self.transport.abort()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        if len(self.connections) > self.max_connections:
            log.warning(
                "http_connection_refused", reason="too many connections", limit=self.max_connections
            )
            self.transport.write(_TOO_MANY)
            # Out of the cap's count (a refusal must not take a place), and only so many at
            # once, each for at most a second: a flood of connections holds at most
            # `max_connections + MAX_LINGERING` sockets.
            self.connections.discard(self)
            if len(self.lingering) >= MAX_LINGERING:
                self.transport.close()
                return
            self.lingering.add(self)
            if self.transport.can_write_eof():  # plain TCP: the client sees the end now
                self.transport.write_eof()
            self._refused = self.loop.call_later(REFUSED_LINGER_S, self.transport.close)
            return
        self._await_head()

    def data_received(self, data: bytes) -> None:
        if self._refused is not None:
            return  # dropped unparsed: read only so that closing does not reset
        super().data_received(data)
        if self._head_timer is not None and self.cycle is not self._awaited_after:
            self._stop_timer()  # a whole head has arrived: uvicorn began a new cycle

    def on_response_complete(self) -> None:
        finished = self.cycle
        super().on_response_complete()
        if not self.transport.is_closing() and self.cycle is finished:
            # The next request's head (unless a pipelined one has begun already).
            # uvicorn's keep-alive timer closes a connection that stays silent, but any
            # byte stops it for good: this one also closes one that sends half a head,
            # or dribbles the rest of a body its answer went out before.
            self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        if self._refused is not None:
            self._refused.cancel()
            self.lingering.discard(self)
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        super().connection_lost(exc)

    def _await_head(self) -> None:
        self._stop_timer()
        self._awaited_after = self.cycle
        self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_too_slow)

    def _stop_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if self.cycle is self._awaited_after and not self.transport.is_closing():
            self.transport.close()


class _EmbeddedServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config) -> None:
        self._exit = asyncio.Event()
        super().__init__(config)

    @property
    def should_exit(self) -> bool:
        return self._exit.is_set()

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        if value:
            self._exit.set()
        else:
            self._exit.clear()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # signals belong to rerank-server, which stops this server itself

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        # A TLS connection reaches the protocol above (its head deadline, the connection
        # cap) only once its handshake is done, and asyncio gives a handshake 60 s by
        # default: a client that connects and sends nothing would hold its socket that
        # long, uncounted. uvicorn has no setting for it, so its one `create_server` call
        # gets the same deadline as a head.
        # Its closing, likewise, waits TLS_SHUTDOWN_S for the client's close_notify.
        loop = asyncio.get_running_loop()
        create_server = loop.create_server
        own = vars(loop).get("create_server")  # an instance attribute already there, if any

        def bounded(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("ssl") is not None:
                kwargs.setdefault("ssl_handshake_timeout", HEAD_TIMEOUT_S)
                kwargs.setdefault("ssl_shutdown_timeout", TLS_SHUTDOWN_S)
            return create_server(*args, **kwargs)

        loop.create_server = bounded  # type: ignore[method-assign]
        try:
            await super().startup(sockets)
        finally:
            if own is None:
                del loop.create_server  # the instance attribute: the class's method again
            else:
                loop.create_server = own  # type: ignore[method-assign]

    async def main_loop(self) -> None:
        # uvicorn's own loop wakes every 0.1 s to look at `should_exit`; its tick's work
        # (the Date header) is once a second. An idle sidecar should not wake ten times a
        # second for that: tick each second and stop as soon as `should_exit` is set.
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + TICKS_PER_S) % 864000
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await self._exit.wait()


class HttpEdge:
    """A started uvicorn server; `aclose` stops it, letting requests in flight finish."""

    def __init__(
        self,
        server: _EmbeddedServer,
        task: asyncio.Task[None],
        port: int,
        reload: asyncio.Task[None] | None,
    ) -> None:
        self._server = server
        self._task = task
        self.port = port
        self._reload = reload

    @classmethod
    async def start(
        cls,
        app: FastAPI,
        settings: Settings,
        tls: CertificateFiles | None = None,
        reuse_port: bool = False,
    ) -> HttpEdge:
        sock = _bind(settings.host, settings.http_port, reuse_port)
        # A class per server: the cap is this server's setting, not a process-wide one.
        protocol = type(
            "BoundedH11",
            (_BoundedH11,),
            {"max_connections": settings.max_connections, "lingering": set()},
        )
        config = uvicorn.Config(
            app,
            lifespan="off",
            log_config=None,
            log_level="warning",
            access_log=False,
            http=protocol,
            # The grace period as it is (uvicorn waits with it as a float): rounded down to
            # whole seconds it cut requests short of what the gRPC edge allows them.
            timeout_graceful_shutdown=settings.grace_period_s,  # type: ignore[arg-type]
            ssl_certfile=str(tls.cert) if tls else None,
            ssl_keyfile=str(tls.key) if tls else None,
            ssl_ca_certs=str(tls.client_ca) if tls and tls.client_ca else None,
            ssl_cert_reqs=ssl.CERT_REQUIRED if tls and tls.mutual else ssl.CERT_NONE,
        )
        server = _EmbeddedServer(config)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            if task.done():
                sock.close()
                task.result()  # raises what stopped it
                raise OSError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        reload = asyncio.create_task(_reload_certificates(config, tls)) if tls else None
        return cls(server, task, sock.getsockname()[1], reload)

    async def aclose(self) -> None:
        if self._reload is not None:
            self._reload.cancel()
        self._server.should_exit = True
        await asyncio.gather(self._task, return_exceptions=True)


def _bind(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:  # sibling workers listen on the same port (`rerank_server.workers`)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise BindError(
            "--http-port / RERANK_HTTP_PORT", host_port(host, port), exc.strerror or ""
        ) from None
    sock.set_inheritable(True)
    return sock


async def _reload_certificates(config: uvicorn.Config, tls: CertificateFiles) -> None:
    """Every few seconds: new files go into a fresh context, which the live one hands each
    new handshake to (`sni_callback`). A failed load leaves the current one in place."""
    live = config.ssl
    if live is None:
        return
    current = live

    def switch(connection: ssl.SSLObject, _name: str | None, _ctx: ssl.SSLContext) -> None:
        connection.context = current

    live.sni_callback = switch
    while True:
        await asyncio.sleep(RELOAD_EVERY_S)
        times = tls.changed()
        if times is None:
            continue
        try:
            fresh = tls.server_context()
        except (OSError, ssl.SSLError) as exc:
            log.warning("tls_certificate_reload_failed", error=type(exc).__name__)
            continue
        current = fresh
        tls.loaded(times)
        log.info("tls_certificate_reloaded", port="http")
