"""Server assembly and lifecycle: `build_server` for main and tests, `serve` for main.

grpc.aio objects belong to the event loop that made them (grpc/grpc#32480), so
`build_server` is a coroutine called inside the running loop, by `serve` and by the test
fixtures alike.

Shutdown order on SIGTERM/SIGINT (as uvicorn's `capture_signals`/`handle_exit`): health
goes NOT_SERVING so load balancers stop sending, the server stops taking new calls and
gives in-flight ones `grace_period_s`, then the backend clients close.
"""

from __future__ import annotations

import asyncio
import signal
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from . import __version__
from .pb import rerank_pb2 as pb
from .pb import rerank_pb2_grpc as pb_grpc
from .pipeline import Reranker
from .scoring.base import Scorer
from .scoring.chat import ChatScorer
from .scoring.http import HttpBackend
from .service import RerankService
from .settings import Settings

log = structlog.get_logger(__name__)

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["Reranker"].full_name


def build_scorer(settings: Settings) -> Scorer:
    """The scorer for `settings.backend` against `settings.backend_url`."""
    http = HttpBackend(settings.backend_url, settings.concurrency,
                       settings.backend_timeout_ms / 1000)
    return ChatScorer(http, model=settings.model, assistant_prefill=settings.assistant_prefill)


class _ContextInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Starts each RPC with fresh log context so nothing leaks between calls."""

    async def intercept_service(self, continuation: Any,
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(method=handler_call_details.method)
        return await continuation(handler_call_details)


@dataclass
class RunningServer:
    """A started server and what it owns."""

    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    reranker: Reranker
    settings: Settings
    _stopped: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def address(self) -> str:
        host = self.settings.host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    async def stop(self, grace: float | None = None) -> None:
        """Drain and stop: NOT_SERVING, refuse new calls, let in-flight ones finish."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        await self.health.enter_graceful_shutdown()
        await self.server.stop(self.settings.grace_period_s if grace is None else grace)
        await self.reranker.scorer.aclose()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()
        await self.server.wait_for_termination()


async def build_server(settings: Settings, scorer: Scorer | None = None) -> RunningServer:
    """Create, bind and start the server; the port is the bound one (settings.port may be 0)."""
    reranker = Reranker(settings, scorer or build_scorer(settings))
    options = [
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.max_send_message_length", settings.max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]
    server = grpc.aio.server(interceptors=[_ContextInterceptor()], options=options,
                             maximum_concurrent_rpcs=settings.max_concurrent_rpcs)
    pb_grpc.add_RerankerServicer_to_server(RerankService(reranker), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if settings.reflection:
        names = (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                 reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
    port = server.add_insecure_port(settings.address)
    if port == 0:
        raise OSError(f"cannot listen on {settings.address}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(server, port, health_servicer, reranker, settings)


async def serve(settings: Settings) -> None:
    """Run until SIGTERM or SIGINT, then shut down in order."""
    running = await build_server(settings)
    log.info("serving", address=running.address, backend=settings.backend,
             backend_url=settings.backend_url, version=__version__)
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_requested.set)
    try:
        await stop_requested.wait()
        log.info("shutting_down", grace_period_s=settings.grace_period_s)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await running.stop()
    log.info("stopped")
