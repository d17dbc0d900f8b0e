"""`--workers N`: N server processes sharing one port, under a supervisor.

What the supervisor does: docs/architecture.md, "Workers"; when to use them: docs/deploy.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import math
import multiprocessing
import os
import signal
import socket
import sys
import time
from collections.abc import Mapping
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path

import structlog

from .api.grpc_server import check_free
from .errors import BindError, ConfigError
from .loops import loop_factory
from .managed.start import start_managed
from .observability import logs
from .observability.instruments import Adder
from .observability.telemetry import metrics_endpoint
from .observability.worker_metrics import SupervisorMetrics, merged_app
from .server import RunningServer, serve, stop_signals
from .settings import Settings, host_port

log = structlog.get_logger(__name__)

RESTART_DELAY_S = 1.0  # between a worker's death and its replacement; doubles while
RESTART_DELAY_MAX_S = 30.0  # replacements keep failing, up to this,
STABLE_AFTER_S = 60.0  # and starts again from RESTART_DELAY_S once one has served this long
STOP_MARGIN_S = 5.0  # beyond the grace period, before a worker that has not exited is killed
PR_SET_PDEATHSIG = 1
CGROUP = Path("/sys/fs/cgroup")


def worker_count(settings: Settings, cgroup: Path = CGROUP) -> int:
    """How many server processes `settings` ask for. 0: one per core this process may
    use, which in a container with a CPU limit is the limit (rounded up), not the node's
    cores; and no more than --concurrency, since each worker needs a backend slot (the
    default 4 slots on a 16-core node: 4 workers, not a refusal to start)."""
    if settings.workers:
        return settings.workers
    cores = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    quota = cpu_quota(cgroup)
    usable = max(1, min(cores, math.ceil(quota))) if quota else cores
    return max(1, min(usable, settings.concurrency))


def cpu_quota(cgroup: Path = CGROUP) -> float | None:
    """The CPU limit of this process's cgroup in cores (cgroup v2 `cpu.max`, else v1's
    CFS quota); None when there is none."""
    with contextlib.suppress(OSError, ValueError):
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    with contextlib.suppress(OSError, ValueError):
        quota_us = int((cgroup / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((cgroup / "cpu" / "cpu.cfs_period_us").read_text())
        return quota_us / period_us if quota_us > 0 else None
    return None


def concurrency_shares(total: int, workers: int) -> list[int]:
    """`total` backend slots split as evenly as possible; every worker needs one."""
    if total < workers:
        raise ConfigError(
            f"--concurrency / RERANK_CONCURRENCY: {total} backend slots "
            f"cannot be split between {workers} workers (--workers); each "
            "needs at least one"
        )
    return [total // workers + (i < total % workers) for i in range(workers)]


async def run(settings: Settings) -> None:
    """The server: in this process, or as `--workers` processes under a supervisor."""
    count = worker_count(settings)
    if count == 1:
        await serve(settings)
    else:
        await _supervise(settings, count)


async def _supervise(settings: Settings, count: int) -> None:
    shares = concurrency_shares(settings.concurrency, count)
    with contextlib.ExitStack() as reserved:
        port = _reserve(reserved, settings.host, settings.port, "--port / RERANK_PORT")
        http_port = settings.http_port and _reserve(
            reserved, settings.host, settings.http_port, "--http-port / RERANK_HTTP_PORT"
        )
        settings = dataclasses.replace(settings, port=port, http_port=http_port)
        own = SupervisorMetrics()
        async with contextlib.AsyncExitStack() as stack:
            if settings.managed:
                settings, managed = await start_managed(settings, own.llama_restarts)
                stack.push_async_callback(managed.stop)
            workers = _Workers(settings, shares, own.worker_restarts)
            stack.push_async_callback(workers.stop)
            metrics_port = None
            if settings.metrics:
                metrics = metrics_endpoint(settings, merged_app(workers.metrics_ports, own))
                stack.callback(metrics.server_close)
                stack.callback(metrics.shutdown)
                metrics_port = metrics.server_port
            # A second signal, once the drain has begun, ends the workers at once; caught
            # from the first on: with the default action back, it ended the supervisor
            # (and its llama-server) while the workers drained on, orphans scoring
            # against a dead backend until their grace period ran out.
            with stop_signals(on_repeat=workers.kill) as stop_requested:
                await workers.start(stop_requested)
                if not stop_requested.is_set():
                    log.info(
                        "serving",
                        address=host_port(settings.host, port),
                        http_port=http_port or None,
                        workers=count,
                        concurrency=settings.concurrency,
                        backend=settings.backend,
                        backend_url=settings.backend_url,
                        managed=settings.managed,
                        metrics_port=metrics_port,
                    )
                    await workers.watch(stop_requested)
            log.info("shutting_down", grace_period_s=settings.grace_period_s, workers=count)
    log.info("stopped")


def _reserve(stack: contextlib.ExitStack, host: str, port: int, setting: str) -> int:
    """Bind (never listen) `host:port` with SO_REUSEPORT on every address it resolves to,
    held until the stack closes; the port, resolved when 0.

    First a bind without SO_REUSEPORT: the reservation alone would share the port with
    any program of this user that holds it with SO_REUSEPORT (another rerank-server
    with workers, any gRPC server on default options), and the kernel would then split
    the connections between the two."""
    check_free(host, port, setting)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise BindError("--host / RERANK_HOST", host_port(host, port), str(exc)) from None
    for family, kind, proto, _, address in infos:
        sock = stack.enter_context(socket.socket(family, kind, proto))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((address[0], port, *address[2:]))
        except OSError as exc:
            raise BindError(setting, host_port(host, port), exc.strerror or "") from None
        port = sock.getsockname()[1]  # the other addresses take the same one
    return port


@dataclasses.dataclass
class _Worker:
    index: int
    settings: Settings
    process: BaseProcess
    conn: Connection
    spawned_at: float = dataclasses.field(default_factory=time.monotonic)
    metrics_port: int | None = None
    ready: bool = False
    ready_at: float = 0.0
    restart_at: float | None = None  # dead (or given up on), replaced at this time


class _Workers:
    """The worker processes: started, watched and restarted, stopped."""

    def __init__(self, settings: Settings, shares: list[int], restarts: Adder) -> None:
        self._restarts = restarts
        self._settings = [
            dataclasses.replace(
                settings,
                workers=1,
                concurrency=share,
                managed=False,
                metrics_host="127.0.0.1",
                metrics_port=0,
            )
            for share in shares
        ]
        self._start_timeout_s = settings.worker_start_timeout_s
        self._context = multiprocessing.get_context("spawn")
        self._workers: list[_Worker] = []
        # Per worker slot: replacements that failed in a row (died before serving
        # STABLE_AFTER_S, or never listened), which sets the next delay.
        self._failures = [0] * len(shares)

    def metrics_ports(self) -> Mapping[str, int]:
        return {
            str(w.index): w.metrics_port for w in list(self._workers) if w.ready and w.metrics_port
        }

    def _spawn(self, index: int) -> _Worker:
        ours, theirs = self._context.Pipe(duplex=False)
        process = self._context.Process(
            target=_worker_main,
            args=(self._settings[index], index, os.getpid(), theirs),
            name=f"rerank-worker-{index}",
            daemon=False,
        )
        process.start()
        theirs.close()
        return _Worker(index, self._settings[index], process, ours)

    async def start(self, stop_requested: asyncio.Event) -> None:
        """Start every worker and wait until all listen; raise the first one's error."""
        self._workers = [self._spawn(i) for i in range(len(self._settings))]
        deadline = time.monotonic() + self._start_timeout_s
        while not all(w.ready for w in self._workers) and not stop_requested.is_set():
            for w in self._workers:
                if not w.ready and (error := self._poll(w)) is not None:
                    raise error
            if time.monotonic() > deadline:
                raise ConfigError(
                    f"workers did not start listening within "
                    f"{self._start_timeout_s:g} s "
                    "(--worker-start-timeout-s)"
                )
            await asyncio.sleep(0.05)

    def _poll(self, w: _Worker) -> Exception | None:
        """Read what the worker said; the error that ended its start, if it did."""
        while w.conn.poll():
            try:
                kind, value = w.conn.recv()
            except EOFError:
                break
            if kind == "ready":
                w.ready, w.metrics_port, w.ready_at = True, value, time.monotonic()
            else:
                return ConfigError(f"worker {w.index}: {value}")
        if not w.ready and not w.process.is_alive():
            return ConfigError(
                f"worker {w.index} exited with status {w.process.exitcode} "
                "while starting (its log above says why)"
            )
        return None

    async def watch(self, stop_requested: asyncio.Event) -> None:
        """Until stopped: replace a worker that died, or a replacement that did not listen
        in time, after its back-off. Never sleeps longer than a poll, so a stop signal
        during a long back-off is acted on at once."""
        while not stop_requested.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop_requested.wait(), 0.2)
            if stop_requested.is_set():
                return
            now = time.monotonic()
            for i, w in enumerate(self._workers):
                if w.restart_at is not None:
                    if now >= w.restart_at:
                        self._replace(i)
                elif w.ready:
                    if not w.process.is_alive():
                        served = now - w.ready_at
                        self._give_up(
                            w,
                            failed=served < STABLE_AFTER_S,
                            now=now,
                            event="worker_exited",
                            status=w.process.exitcode,
                            served_s=round(served, 1),
                        )
                elif (error := self._poll(w)) is not None:
                    self._give_up(
                        w, failed=True, now=now, event="worker_restart_failed", error=str(error)
                    )
                elif not w.ready and now - w.spawned_at > self._start_timeout_s:
                    # (`_poll` may just have read its "ready".) Alive but not listening,
                    # stuck importing from a hung disk, say: as good as dead, and holding
                    # a share of the backend slots meanwhile.
                    w.process.kill()
                    self._give_up(
                        w,
                        failed=True,
                        now=now,
                        event="worker_restart_failed",
                        error=f"did not listen within {self._start_timeout_s:g} s; killed",
                    )

    def _give_up(
        self, w: _Worker, *, failed: bool, now: float, event: str, **fields: object
    ) -> None:
        """Schedule worker `w`'s replacement: after RESTART_DELAY_S, doubled for each
        replacement in a row that failed, at most RESTART_DELAY_MAX_S."""
        self._failures[w.index] = self._failures[w.index] + 1 if failed else 0
        delay = min(RESTART_DELAY_S * 2 ** max(self._failures[w.index] - 1, 0), RESTART_DELAY_MAX_S)
        w.restart_at = now + delay
        log.warning(event, worker=w.index, restarting_in_s=delay, **fields)

    def _replace(self, i: int) -> None:
        """Worker `i` again; counted, every try of a crash loop too."""
        old = self._workers[i]
        old.conn.close()
        if old.process.is_alive():  # said why it cannot start, and has not exited yet
            old.process.kill()
        old.process.join(1)  # reap it
        self._workers[i] = self._spawn(old.index)
        self._restarts.add(1)

    def kill(self) -> None:
        """A second stop signal during the drain: end every worker now, as a second
        signal ends a single server's drain."""
        log.warning("workers_killed", reason="a second stop signal")
        for w in self._workers:
            if w.process.is_alive():
                w.process.kill()

    async def stop(self) -> None:
        """SIGTERM to every worker (each drains within the grace period), then wait; kill
        what is still running after the grace period and a margin."""
        for w in self._workers:
            if w.process.is_alive() and w.process.pid is not None:
                os.kill(w.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + self._settings[0].grace_period_s + STOP_MARGIN_S
        for w in self._workers:
            await asyncio.to_thread(w.process.join, max(deadline - time.monotonic(), 0.0))
        for w in self._workers:
            if w.process.is_alive():
                log.warning("worker_killed", worker=w.index, reason="did not stop in time")
                w.process.kill()
            w.process.join(1)
            w.conn.close()


def _worker_main(settings: Settings, index: int, supervisor: int, conn: Connection) -> None:
    """A worker process: a whole server on the shared ports, until SIGTERM."""
    # A process group of its own: Ctrl-C in a terminal (SIGINT to the foreground group)
    # reaches the supervisor alone, which then stops each worker once. A worker signalled
    # directly as well would take the supervisor's SIGTERM as a second signal and end at
    # once, dropping the calls it was draining.
    os.setpgid(0, 0)
    _exit_with(supervisor)
    logs.configure(settings.log_level, settings.log_format, extra={"worker": index})

    def ready(running: RunningServer) -> None:
        conn.send(("ready", running.telemetry.metrics_port))

    try:
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            runner.run(serve(settings, reuse_port=True, ready=ready, drain_through_repeats=True))
    except (BindError, ConfigError) as exc:
        conn.send(("error", str(exc)))
        sys.exit(2)


def _exit_with(supervisor: int) -> None:
    """Linux: have the kernel send SIGTERM to this worker when its supervisor dies, even
    by SIGKILL, so no worker outlives it holding the port."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != supervisor:  # it died before the request above took effect
        sys.exit(0)
