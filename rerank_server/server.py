"""Server assembly and lifecycle: `build_server` for main and tests, `serve` for main.

grpc.aio objects belong to the event loop that made them (grpc/grpc#32480), so
`build_server` is a coroutine called inside the running loop, by `serve` and by the test
fixtures alike.

Shutdown order on SIGTERM/SIGINT (as uvicorn's `capture_signals`/`handle_exit`): health
goes NOT_SERVING so load balancers stop sending, the server stops taking new calls and
gives in-flight ones `grace_period_s`, then the backend clients close, a managed
llama-server is stopped, and telemetry is flushed last.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from . import __version__
from .api.interceptors import RpcInterceptor
from .api.pb import rerank_pb2 as pb
from .api.pb import rerank_pb2_grpc as pb_grpc
from .api.service import RerankService
from .managed import assets
from .managed.llama_server import ManagedLlamaServer, default_log_path, split_args
from .observability.metrics import Metrics
from .observability.telemetry import Telemetry
from .ranking import blend_profiles
from .ranking.blend_profiles import BlendProfiles
from .ranking.pipeline import Reranker
from .ranking.score_cache import ScoreCache
from .scoring.backend_pool import BackendPool
from .scoring.base import Scorer
from .scoring.monitor import BackendMonitor
from .scoring.registry import build_pool, build_scorer
from .settings import Settings

log = structlog.get_logger(__name__)

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["Reranker"].full_name


def _interceptors(settings: Settings, telemetry: Telemetry) -> list[grpc.aio.ServerInterceptor]:
    """Tracing outermost (so the log line and metrics see the span), then ours."""
    ours = RpcInterceptor(telemetry.metrics, SERVICE_NAME, settings.max_concurrent_rpcs)
    if not telemetry.tracing:
        return [ours]
    from opentelemetry.instrumentation.grpc import aio_server_interceptor, filters

    # Health checks every few seconds would bury the traces that matter.
    tracing = aio_server_interceptor(  # type: ignore[no-untyped-call]
        tracer_provider=telemetry.tracer_provider,
        filter_=filters.negate(filters.service_prefix("grpc.")))
    return [tracing, ours]


@dataclass
class RunningServer:
    """A started server and what it owns."""

    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    reranker: Reranker
    settings: Settings
    monitor: BackendMonitor
    pool: BackendPool
    telemetry: Telemetry
    managed: ManagedLlamaServer | None = None
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
        await self.monitor.stop()
        await self.reranker.scorer.aclose()
        await self.pool.aclose()  # the scorer's own; again only for an injected scorer
        await self.reranker.cache.aclose()
        if self.managed is not None:
            await self.managed.stop()
        await asyncio.to_thread(self.telemetry.shutdown)


async def start_managed(settings: Settings, metrics: Metrics | None = None,
                        ) -> tuple[Settings, ManagedLlamaServer]:
    """Prepare assets, start llama-server, and point the settings at it."""
    cache = settings.cache_dir
    binary, model = await asyncio.to_thread(
        _resolve_assets, cache, settings.llama_server, settings.model_path)
    managed = ManagedLlamaServer(
        binary, model, slots=settings.llama_slots or settings.concurrency,
        ctx_per_slot=settings.llama_ctx_per_slot, extra_args=split_args(settings.llama_args),
        log_path=default_log_path(cache), ready_timeout_s=settings.llama_ready_timeout_s,
        metrics=metrics)
    await managed.start()
    changes: dict[str, object] = {"backend_url": managed.url}
    if not settings.model_path and settings.assistant_prefill:
        # The stand-in chat model does not know Qwen3-Reranker's think block: with it, no
        # yes/no token reaches its top logprobs and every pair would fail.
        changes["assistant_prefill"] = False
        log.info("assistant_prefill_off", reason="stand-in model")
    return dataclasses.replace(settings, **changes), managed  # type: ignore[arg-type]


def _open_cache(settings: Settings) -> ScoreCache:
    path = Path(settings.cache_path).expanduser() if settings.cache_path else None
    return ScoreCache(settings.cache_entries, settings.cache_ttl_s, path)


def _resolve_assets(cache: Path, llama_server: str, model_path: str) -> tuple[Path, Path]:
    binary = assets.resolve_llama_server(Path(llama_server) if llama_server else None, cache,
                                         build=True)
    model = assets.resolve_model(Path(model_path) if model_path else None, cache,
                                 fetch_missing=True)
    return binary, model


async def build_server(settings: Settings, scorer: Scorer | None = None,
                       telemetry: Telemetry | None = None) -> RunningServer:
    """Create, bind and start the server; the port is the bound one (settings.port may be 0).

    In managed mode this first starts llama-server (building or fetching assets that are
    missing), which can take minutes the first time. `telemetry` defaults to what the
    settings ask for; tests pass their own to read spans.
    """
    profiles = blend_profiles.load(settings.blend_profile)  # before minutes of setup
    telemetry = telemetry or Telemetry.create(settings)
    managed = None
    try:
        if settings.managed:
            settings, managed = await start_managed(settings, telemetry.metrics)
        return await _build(settings, scorer, managed, telemetry, profiles)
    except BaseException:
        if managed is not None:
            await managed.stop()
        telemetry.shutdown()
        raise


async def _build(settings: Settings, scorer: Scorer | None,
                 managed: ManagedLlamaServer | None, telemetry: Telemetry,
                 profiles: BlendProfiles) -> RunningServer:
    cache = await asyncio.to_thread(_open_cache, settings)  # may open a SQLite file
    pool = build_pool(settings, telemetry)
    reranker = Reranker(settings, scorer or build_scorer(settings, pool), telemetry, cache,
                        profiles)
    options = [
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.max_send_message_length", settings.max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]
    server = grpc.aio.server(interceptors=_interceptors(settings, telemetry), options=options)
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
    monitor = BackendMonitor(reranker.scorer, pool, settings.instruction, health_servicer,
                             SERVICE_NAME, settings.health_interval_s,
                             run_probe=settings.probe, metrics=telemetry.metrics)
    monitor.start()
    return RunningServer(server, port, health_servicer, reranker, settings, monitor, pool,
                         telemetry, managed)


async def serve(settings: Settings) -> None:
    """Run until SIGTERM or SIGINT, then shut down in order."""
    running = await build_server(settings)
    log.info("serving", address=running.address, backend=running.settings.backend,
             backend_url=running.settings.backend_url, managed=settings.managed,
             metrics_port=running.telemetry.metrics_port, tracing=running.telemetry.tracing,
             blend=settings.blend_strategy.value, blend_profiles=running.reranker.profiles.source,
             version=__version__)
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
