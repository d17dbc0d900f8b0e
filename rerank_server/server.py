"""Server assembly and lifecycle: `build_server` for main and tests, `serve` for main.

What is opened in what order, and how it stops: docs/architecture.md, "The server".
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from . import __version__, model_specs
from .allocator import MemoryReturn
from .api.grpc_server import GrpcEdge, check_free
from .http_api.app import create_app
from .http_api.server import HttpEdge
from .managed import memory
from .managed.llama_server import ManagedLlamaServer
from .managed.start import start_managed
from .model_specs import ModelSpec
from .observability.loop_lag import LoopLag
from .observability.telemetry import Telemetry
from .ranking import blend_profiles
from .ranking.blend_profiles import BlendResolver
from .ranking.pipeline import Reranker
from .ranking.request import RequestRules
from .ranking.score_cache import ScoreCache
from .ranking.served_models import ServedModel, ServedModels
from .scoring.base import Scorer
from .scoring.monitor import BackendMonitor
from .scoring.registry import build_pool, build_scorer
from .scoring.transport.pool import BackendPool
from .security.inflight_bytes import InflightBytes
from .security.tls import CertificateFiles
from .security.tokens import TokenSet
from .settings import Settings, host_port

log = structlog.get_logger(__name__)

SHUTDOWN_MARGIN_S = 1.0  # answers are due this long before the grace period ends


def request_rules(settings: Settings) -> RequestRules:
    """What the ranking core needs of the settings, read once at start."""
    s = settings
    return RequestRules(
        max_request_candidates=s.max_request_candidates,
        max_query_chars=s.max_query_chars,
        max_document_chars=s.max_document_chars,
        max_id_chars=s.max_id_chars,
        max_lists=s.max_lists,
        max_metadata_entries=s.max_metadata_entries,
        max_metadata_key_chars=s.max_metadata_key_chars,
        max_metadata_value_chars=s.max_metadata_value_chars,
        max_metadata_request_chars=s.max_metadata_request_chars,
        blend=s.blend_strategy,
        instruction=s.instruction,
        timeout_s=s.timeout_ms / 1000,
        max_candidates=s.max_candidates,
        max_chunk_chars=s.max_chunk_chars,
        max_tokens_per_doc=s.max_tokens_per_doc,
        fusion_k=s.fusion_k,
        original_list_weight=s.original_list_weight,
        expansion_list_weight=s.expansion_list_weight,
        skip_within_top_k=s.skip_within_top_k,
        strong_signal_skip=s.strong_signal_skip,
        disabled=s.disabled,
        min_candidates=s.min_candidates,
        strong_signal_min=s.strong_signal_min,
        strong_signal_gap=s.strong_signal_gap,
    )


@dataclass
class ServedStack:
    """One served model and what it owns: its settings (pointed at its backend), pool,
    pipeline, monitor and, in managed mode, its llama-server."""

    name: str
    settings: Settings
    pool: BackendPool
    reranker: Reranker
    managed: ManagedLlamaServer | None
    aliases: tuple[str, ...] = ()
    monitor: BackendMonitor | None = None

    def served(self) -> ServedModel:
        return ServedModel(
            self.name, self.reranker, lambda: self._backend_up(), aliases=self.aliases
        )

    def _backend_up(self) -> bool | None:
        return None if self.monitor is None else self.monitor.backend_up


@dataclass
class RunningServer:
    """A started server and what it owns; `reranker`, `monitor`, `pool`, `managed` and
    `settings` are the default model's, `stacks` every model's."""

    edge: GrpcEdge
    models: ServedModels
    stacks: list[ServedStack]
    telemetry: Telemetry
    _resources: contextlib.AsyncExitStack
    http: HttpEdge | None = None
    _stopped: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def _default(self) -> ServedStack:
        return next(s for s in self.stacks if s.reranker is self.models.default.reranker)

    @property
    def reranker(self) -> Reranker:
        return self._default.reranker

    @property
    def settings(self) -> Settings:
        return self._default.settings

    @property
    def monitor(self) -> BackendMonitor:
        monitor = self._default.monitor
        assert monitor is not None  # set before the server is returned
        return monitor

    @property
    def pool(self) -> BackendPool:
        return self._default.pool

    @property
    def managed(self) -> ManagedLlamaServer | None:
        return self._default.managed

    @property
    def port(self) -> int:
        return self.edge.port

    @property
    def address(self) -> str:
        return host_port(self.settings.host, self.port)

    @property
    def http_port(self) -> int | None:
        return None if self.http is None else self.http.port

    async def stop(self, grace: float | None = None) -> None:
        """Drain and stop: NOT_SERVING, refuse new calls, let in-flight ones finish."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        if grace is not None:
            self.edge.grace_s = grace
        # In-flight requests answer (SHUTTING_DOWN) a little before the grace period ends,
        # so their answers are out before the server cancels what is left.
        grace_s = self.edge.grace_s
        for stack in self.stacks:
            stack.reranker.stop_scoring_after(grace_s - min(SHUTDOWN_MARGIN_S, grace_s / 4))
        await self._resources.aclose()


class _Edges:
    """Both edges stop together: health NOT_SERVING first, then gRPC and HTTP drain at the
    same time within one grace period (not one after the other)."""

    def __init__(self, grpc_edge: GrpcEdge) -> None:
        self.grpc = grpc_edge
        self.http: HttpEdge | None = None

    async def aclose(self) -> None:
        await self.grpc.health.enter_graceful_shutdown()
        await asyncio.gather(
            self.grpc.aclose(), *([self.http.aclose()] if self.http is not None else [])
        )


def _open_cache(settings: Settings, telemetry: Telemetry) -> ScoreCache:
    path = Path(settings.cache_path).expanduser() if settings.cache_path else None
    shared = None
    if settings.cache_url:  # redis-py imported only then; the cache's aclose closes it
        from .fleet.shared_cache import RedisScoreTier

        shared = RedisScoreTier.from_settings(settings, telemetry.metrics)
    return ScoreCache(
        settings.cache_entries,
        settings.cache_ttl_s,
        path,
        metrics=telemetry.metrics,
        shared=shared,
    )


async def build_server(
    settings: Settings,
    scorer: Scorer | None = None,
    telemetry: Telemetry | None = None,
    reuse_port: bool = False,
) -> RunningServer:
    """Create, bind and start the server; the port is the bound one (settings.port may be 0).

    In managed mode this first starts a llama-server per model (building or fetching
    assets that are missing), which can take minutes the first time. `telemetry` defaults
    to what the settings ask for; tests pass their own to read spans. `scorer` (tests)
    scores the first model. The server owns what it is given and closes it on stop.
    `reuse_port`: a worker sharing its ports with siblings (`workers.py`).
    """
    plan = model_specs.plan(settings)
    model_settings = [spec.settings(settings) for spec in plan.models]
    # Before minutes of setup: a profile file that does not load is refused now.
    profiles = {s.blend_profile: blend_profiles.load(s.blend_profile) for s in model_settings}
    # Checked now, before minutes of setup; both edges serve with them.
    tls = CertificateFiles.from_paths(settings.tls_cert, settings.tls_key, settings.tls_client_ca)
    if settings.api_key:
        log.warning(
            "deprecated_setting",
            setting="--api-key / RERANK_API_KEY",
            use="--backend-api-key / RERANK_BACKEND_API_KEY",
            meaning="the key rerank-server sends TO its backend; callers of "
            "rerank-server authenticate with --auth-tokens",
        )
    async with contextlib.AsyncExitStack() as stack:
        telemetry = telemetry or Telemetry.create(settings)
        stack.push_async_callback(asyncio.to_thread, telemetry.shutdown)
        counter = None
        if settings.cache_url:  # redis-py imported only then; replicas count limits together
            from .fleet.limit_counter import RedisLimitCounter

            counter = RedisLimitCounter.from_settings(settings, telemetry.metrics)
            stack.push_async_callback(counter.aclose)  # after the edges: places given back
        tokens = TokenSet.load(settings.auth_tokens, settings.auth_tokens_file, counter)
        if any(s.managed for s in model_settings) and not reuse_port:
            # Before llama-server loads (minutes, the first time), not after. (A worker's
            # ports are its supervisor's, checked there.)
            check_free(settings.host, settings.port)
            if settings.http_port:
                check_free(settings.host, settings.http_port, "--http-port / RERANK_HTTP_PORT")
        cache = await asyncio.to_thread(_open_cache, settings, telemetry)  # may open SQLite
        stack.push_async_callback(cache.aclose)
        lag = LoopLag()
        lag.start()
        stack.push_async_callback(lag.stop)
        stacks: list[ServedStack] = []
        for i, (spec, own) in enumerate(zip(plan.models, model_settings, strict=True)):
            stacks.append(
                await _start_model(
                    spec,
                    own,
                    telemetry,
                    stack,
                    cache,
                    BlendResolver(profiles[own.blend_profile]),
                    lambda: lag.recent_s,
                    scorer if i == 0 else None,
                    _started_estimate(stacks),
                )
            )
        _say_models(stacks)
        models = ServedModels([s.served() for s in stacks], plan.default)
        rules = request_rules(settings)
        # Both edges share it; what they give back may be returned to the system.
        inflight = InflightBytes(settings.max_inflight_bytes, MemoryReturn().freed)
        edge = await GrpcEdge.start(
            settings,
            models,
            telemetry,
            rules,
            tokens,
            inflight=inflight,
            tls=tls,
            reuse_port=reuse_port,
        )
        edges = _Edges(edge)
        stack.push_async_callback(edges.aclose)
        for served in stacks:
            is_default = served.reranker is models.default.reranker
            served.monitor = _monitor(served, edge, telemetry, is_default=is_default)
            stack.push_async_callback(served.monitor.stop)
        http = None
        if settings.http_port:
            app = create_app(
                models,
                telemetry=telemetry,
                rules=rules,
                tokens=tokens,
                inflight=inflight,
                max_body_bytes=settings.max_message_bytes,
                max_active=settings.max_concurrent_rpcs,
                default_blend=settings.http_blend_strategy,
            )
            http = edges.http = await HttpEdge.start(
                app,
                settings,
                tls,
                reuse_port=reuse_port,
            )
        await edge.serving()
        return RunningServer(edge, models, stacks, telemetry, stack.pop_all(), http)
    raise AssertionError("unreachable")  # the stack re-raises whatever broke the start


async def _start_model(
    spec: ModelSpec,
    settings: Settings,
    telemetry: Telemetry,
    stack: contextlib.AsyncExitStack,
    cache: ScoreCache,
    blends: BlendResolver,
    loop_lag: Callable[[], float],
    scorer: Scorer | None,
    started_bytes: int = 0,
) -> ServedStack:
    """One model's backend (its llama-server, in managed mode), pool, scorer and
    pipeline, each closed by `stack` on stop; `started_bytes`: the memory estimated for
    the llama-servers of the models before it."""
    managed = None
    if settings.managed:
        settings, managed = await start_managed(
            settings, telemetry.metrics.llama_restarts, spec.name, started_bytes
        )
        stack.push_async_callback(managed.stop)
    pool = build_pool(settings, telemetry)
    stack.push_async_callback(pool.aclose)
    scorer = scorer or build_scorer(settings, pool)
    stack.push_async_callback(scorer.aclose)
    reranker = Reranker(
        request_rules(settings),
        scorer,
        telemetry,
        cache,
        blends,
        loop_lag,
        name=spec.name,
        identity=managed.identity if managed is not None else "",
    )
    return ServedStack(spec.name, settings, pool, reranker, managed, spec.aliases)


def _monitor(
    served: ServedStack, edge: GrpcEdge, telemetry: Telemetry, is_default: bool
) -> BackendMonitor:
    """The model's backend monitor, started: the default model's backend is the
    server's (`rerank.v1.Reranker/backend`), a named model's also has its own health name
    (`rerank.v1.Reranker/backend/model/NAME`)."""

    async def report(component: str, up: bool) -> None:
        if is_default:
            await edge.report_backend(component, up)
        if served.name:
            # A name's "/" escaped, so that model "en" and model "en/x" never share one.
            name = served.name.replace("/", "%2F")  # NAME holds no "%" to escape
            own = f"model/{name}" + (f"/{component}" if component else "")
            await edge.report_backend(own, up)

    settings = served.settings
    monitor = BackendMonitor(
        served.reranker.scorer,
        served.pool,
        settings.instruction,
        report,
        settings.health_interval_s,
        run_probe=settings.probe,
        metrics=telemetry.metrics,
    )
    monitor.start()
    return monitor


def _say_models(stacks: list[ServedStack]) -> None:
    """One line per served model (when they are named), and what the managed
    llama-servers hold in memory: each one's estimate, and what they hold once all are up."""
    resident = {
        id(s): memory.resident_bytes(s.managed.pid) for s in stacks if s.managed is not None
    }
    named = len(stacks) > 1 or bool(stacks[0].name)
    for s in stacks if named else []:
        file = s.managed.model if s.managed else None
        log.info(
            "model_served",
            model=s.name,
            aliases=list(s.aliases) or None,
            backend=s.settings.backend.value,
            backend_url=None if s.managed else s.settings.backend_url,
            file=file.name if file else None,
            file_bytes=file.stat().st_size if file else None,
            slots=s.managed.slots if s.managed else None,
            ctx_per_slot=s.managed.ctx_per_slot if s.managed else None,
            concurrency=s.settings.concurrency,
            resident_bytes=resident.get(id(s)),
        )
    managed = [s.managed for s in stacks if s.managed is not None]
    if managed:
        estimates = [m.memory.total_bytes if m.memory else None for m in managed]
        held = list(resident.values())
        log.info(
            "managed_memory",
            llama_servers=len(managed),
            estimate_bytes=None if None in estimates else sum(filter(None, estimates)),
            resident_bytes=None if None in held else sum(filter(None, held)),
            container_limit_bytes=memory.container_limit(),
        )


def _started_estimate(stacks: list[ServedStack]) -> int:
    """The memory estimated for the llama-servers already started (their files where
    the metadata did not say more)."""
    m = [s.managed.memory for s in stacks if s.managed is not None and s.managed.memory]
    return sum(e.at_least_bytes for e in m)


async def serve(
    settings: Settings,
    reuse_port: bool = False,
    ready: Callable[[RunningServer], None] | None = None,
    drain_through_repeats: bool = False,
) -> None:
    """Run until SIGTERM or SIGINT, then shut down in order. `ready` is called once the
    server listens (a worker tells its supervisor). A second signal ends the process at
    once, unless `drain_through_repeats` (a worker: its supervisor ends a drain that
    takes too long with SIGKILL, and under systemd's `KillMode=control-group` a worker
    gets SIGTERM from systemd and then again from its supervisor)."""
    running = await build_server(settings, reuse_port=reuse_port)
    freeze_startup_objects()
    log.info(
        "serving",
        address=running.address,
        http_port=running.http_port,
        tls=bool(settings.tls_cert),
        auth=bool(settings.auth_tokens or settings.auth_tokens_file),
        backend=running.settings.backend,
        backend_url=running.settings.backend_url,
        models=running.models.names if len(running.stacks) > 1 else None,
        managed=settings.managed,
        metrics_port=running.telemetry.metrics_port,
        tracing=running.telemetry.tracing,
        blend=settings.blend_strategy.value,
        blend_profiles=running.reranker.blends.profiles.source,
        version=__version__,
    )
    try:
        # A second signal from here on ends the process at once (a worker's SIGTERM:
        # ignored).
        with stop_signals(keep_term=drain_through_repeats) as stop_requested:
            if ready is not None:
                ready(running)
            await stop_requested.wait()
        log.info("shutting_down", grace_period_s=settings.grace_period_s)
    finally:
        await running.stop()
    log.info("stopped")


def freeze_startup_objects() -> None:
    """Put what startup built (modules, the servers, the app) beyond the cyclic garbage
    collector: its full collections then walk only what requests allocate. Tracing keeps
    every span alive while its batch waits for export, which triggers full collections, and
    with the startup objects in them those would be a large part of what tracing costs
    (docs/decisions.md).

    The youngest generation is collected every 10,000 net allocations instead of 700: a
    request allocates thousands of containers (a `completion` answer alone decodes into
    800 dicts), nearly all freed by reference counting, and every 700 a collection
    walked them (docs/decisions.md, "The garbage collector's youngest generation runs
    every 10,000 allocations")."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)


@contextlib.contextmanager
def stop_signals(
    keep_term: bool = False,
    on_repeat: Callable[[], None] | None = None,
) -> Iterator[asyncio.Event]:
    """An event that SIGTERM or SIGINT sets while inside (their default action, ending
    the process at once, is back on leaving). `keep_term`: SIGTERM stays caught on
    leaving, and does nothing. `on_repeat`: both stay caught on leaving, and call it.
    (Setting a handler after leaving left a moment in which the default action was back:
    a worker's second SIGTERM, from its supervisor a moment after systemd's, could land
    there and kill its drain; a supervisor's, and its workers drained on as orphans.)"""
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_requested.set)
    try:
        yield stop_requested
    finally:
        if on_repeat is not None:  # each replaces the one above
            loop.add_signal_handler(signal.SIGTERM, on_repeat)
            loop.add_signal_handler(signal.SIGINT, on_repeat)
        else:
            loop.remove_signal_handler(signal.SIGINT)
            if keep_term:
                loop.add_signal_handler(signal.SIGTERM, _ignored)  # replaces the one above
            else:
                loop.remove_signal_handler(signal.SIGTERM)


def _ignored() -> None:
    """A signal caught so that its default action does not end the process."""
