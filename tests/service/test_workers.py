"""`--workers`: several server processes on one port, as a user runs them (the installed
command, real sockets, the fake llama-server on loopback)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from rerank_client import AsyncRerankClient

from rerank_server.errors import ConfigError
from rerank_server.settings import Settings
from rerank_server.workers import concurrency_shares, worker_count
from tests.conftest import client_of
from tests.fakes.llama import FakeLlamaServer
from tests.server_process import Supervised, supervised
from tests.waiting import eventually

DOCS = ["alpha one", "beta two", "gamma three", "delta four"]


async def _rerank_on_new_connections(port: int, count: int) -> list[Any]:
    """`count` requests at once, each on its own channel (the kernel spreads connections,
    not requests, across workers)."""

    async def one(i: int) -> Any:
        async with AsyncRerankClient(f"127.0.0.1:{port}", own_connection=True) as client:
            return await client.rerank(f"query {i}", DOCS, timeout=30)

    return await asyncio.gather(*(one(i) for i in range(count)))


def _metric_sum(text: str, family: str, by: str) -> dict[str, float]:
    totals: dict[str, float] = {}
    for f in text_string_to_metric_families(text):
        if f.name == family:
            for s in f.samples:
                if s.name == f"{family}_total":
                    totals[s.labels[by]] = totals.get(s.labels[by], 0.0) + s.value
    return totals


async def test_two_workers_answer_on_one_port_and_metrics_merge(
    fake_llama: FakeLlamaServer,
) -> None:
    async with supervised(fake_llama.url) as server:
        assert len(server.workers()) == 2
        answers = await _rerank_on_new_connections(server.port, 16)
        assert all(a.reranked and len(a.results) == 4 for a in answers)
        async with httpx.AsyncClient() as http:
            cohere = await http.post(
                f"http://127.0.0.1:{server.http_port}/v1/rerank",
                json={"query": "q", "documents": DOCS},
            )
            metrics = (await http.get(f"http://127.0.0.1:{server.metrics_port}/metrics")).text
        assert cohere.status_code == 200 and len(cohere.json()["results"]) == 4
        served_by = {e["worker"] for e in server.logged("rpc")}
    assert served_by == {0, 1}, "the kernel gave every connection to one worker"
    by_worker = _metric_sum(metrics, "rerank_requests", "worker")
    assert set(by_worker) == {"0", "1"}
    assert sum(by_worker.values()) == 17  # 16 gRPC + 1 HTTP, each counted once
    assert 'rerank_worker_up{worker="0"} 1.0' in metrics


async def test_workers_share_the_score_cache_on_disk(
    fake_llama: FakeLlamaServer, tmp_path: Path
) -> None:
    """With --cache-path, a pair scored by one worker is a hit for the other: after the
    first request, the same request on new connections (served by both workers) sends
    nothing to the backend."""
    async with supervised(
        fake_llama.url, RERANK_CACHE_PATH=str(tmp_path / "scores.db"), RERANK_CACHE_ENTRIES="0"
    ) as server:
        async with client_of(server, own_connection=True) as client:
            first = await client.rerank("shared query", DOCS, timeout=30)
        scored = len(fake_llama.requests)

        async def again() -> Any:
            async with client_of(server, own_connection=True) as client:
                return await client.rerank("shared query", DOCS, timeout=30)

        answers = await asyncio.gather(*(again() for _ in range(12)))
        served_by = {e["worker"] for e in server.logged("rpc")}
    assert first.summary.cached == 0 and scored == len(DOCS)
    assert served_by == {0, 1}, "the kernel gave every connection to one worker"
    assert all(a.summary.cached == len(DOCS) for a in answers)
    assert len(fake_llama.requests) == scored


async def test_workers_split_the_backend_concurrency(fake_llama: FakeLlamaServer) -> None:
    """--concurrency 3 over 2 workers: the backend never sees more than 3 pairs at once,
    and sees 3 when both workers are busy (2 + 1)."""
    fake_llama.latency_s = 0.1
    async with supervised(fake_llama.url, RERANK_CONCURRENCY="3") as server:
        answers = await _rerank_on_new_connections(server.port, 16)
    assert all(a.reranked for a in answers)
    assert fake_llama.max_in_flight == 3


def _sigterm_to_supervisor(proc: subprocess.Popen[str], _workers: list[int]) -> None:
    proc.send_signal(signal.SIGTERM)  # what Kubernetes does to PID 1


def _ctrl_c(proc: subprocess.Popen[str], _workers: list[int]) -> None:
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal does: the whole foreground group


def _systemd(proc: subprocess.Popen[str], workers: list[int]) -> None:
    """`KillMode=control-group`: SIGTERM to every process of the unit, so each worker
    gets the supervisor's as a second, which must not end its drain (it did: the default
    action, its calls dropped)."""
    for pid in workers:
        os.kill(pid, signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)


@pytest.mark.parametrize("stop", [_sigterm_to_supervisor, _ctrl_c, _systemd])
async def test_a_stop_signal_drains_every_worker_and_exits_zero(
    fake_llama: FakeLlamaServer, stop: Callable[[subprocess.Popen[str], list[int]], None]
) -> None:
    fake_llama.latency_s = 1.0
    # 16 slots a worker: even all 12 requests on one worker score in 3 rounds, within the
    # grace period, so every answer must be complete. 12 connections, not 8: the kernel
    # spreads them at random, and all 8 on one worker (1 run in 128) left the other with
    # nothing to drain.
    async with supervised(
        fake_llama.url, RERANK_CONCURRENCY="32", RERANK_GRACE_PERIOD_S="5"
    ) as server:
        workers = server.workers()
        calls = asyncio.ensure_future(_rerank_on_new_connections(server.port, 12))
        assert await eventually(lambda: fake_llama.in_flight >= 8, 5)
        signalled = time.monotonic()
        stop(server.proc, workers)
        answers = await calls
        code = await asyncio.to_thread(server.proc.wait, 15)
        exited = time.monotonic() - signalled
        served_by = {e["worker"] for e in server.logged("rpc")}
    assert code == 0
    assert all(a.reranked and not a.summary.degraded_code for a in answers), (
        f"in-flight calls were cut short: {[a.summary for a in answers if a.summary.degraded_code]}"
    )
    assert served_by == {0, 1}
    assert exited < 5 + 1
    assert sorted(e["worker"] for e in server.logged("stopped") if "worker" in e) == [0, 1]
    for pid in workers:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


async def test_a_second_stop_signal_ends_the_workers_with_the_supervisor(
    fake_llama: FakeLlamaServer,
) -> None:
    """A second SIGTERM during the drain found the default action back: the supervisor
    died (and a managed llama-server with it) while the workers drained on, orphans,
    for the rest of the grace period. Now it ends them, as it ends a single server."""
    fake_llama.latency_s = 10.0  # nothing finishes within the test
    async with supervised(fake_llama.url, RERANK_GRACE_PERIOD_S="30") as server:
        workers = server.workers()
        calls = asyncio.ensure_future(_rerank_on_new_connections(server.port, 4))
        assert await eventually(lambda: fake_llama.in_flight >= 2, 5)
        server.proc.send_signal(signal.SIGTERM)
        assert await eventually(lambda: bool(server.logged("shutting_down")), 5)
        signalled = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(server.proc.wait, 15)
        exited = time.monotonic() - signalled
        left = []
        for pid in workers:  # before the harness cleans up: no orphan left draining
            for _ in range(40):
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                await asyncio.sleep(0.05)
            else:
                left.append(pid)
        calls.cancel()
        with contextlib.suppress(BaseException):
            await calls
    assert exited < 5, f"the drain went on for {exited:.1f} s"
    assert left == [], "workers outlived their supervisor"
    assert server.logged("workers_killed")


async def test_a_worker_that_dies_is_replaced(fake_llama: FakeLlamaServer) -> None:
    async with supervised(fake_llama.url) as server:
        first = server.workers()
        os.kill(first[0], signal.SIGKILL)
        assert await eventually(lambda: len(server.logged("worker_exited")) == 1, 5)
        assert await eventually(
            lambda: len(server.workers()) == 2 and first[0] not in server.workers(), 10
        )
        # The replacement listens: with it, connections reach both workers again.
        assert await eventually(
            lambda: sum(e.get("event") == "serving" and "worker" in e for e in server.events) == 3,
            30,
        )
        answers = await _rerank_on_new_connections(server.port, 16)
        async with httpx.AsyncClient() as http:
            metrics = (await http.get(f"http://127.0.0.1:{server.metrics_port}/metrics")).text
    assert all(a.reranked for a in answers)
    # Counted by the supervisor, so without a worker label.
    assert supervisor_samples(metrics, "rerank_worker_restarts_total") == [1.0]


async def test_a_crash_loop_backs_off_and_a_stuck_replacement_is_killed(
    fake_llama: FakeLlamaServer,
) -> None:
    """Replacements that keep failing wait longer each time (1, 2, 4 s), so a worker
    that cannot run does not spin; one that never listens (stopped here with SIGSTOP,
    as a hung import would leave it) is killed after --worker-start-timeout-s instead
    of holding its share of the backend slots for ever."""
    async with supervised(fake_llama.url, RERANK_WORKER_START_TIMEOUT_S="8") as server:
        seen = set(server.workers())

        async def replacement() -> int:
            """The PID of the next new worker, as soon as it exists."""

            def new() -> list[int]:
                return [p for p in server.workers() if p not in seen]

            assert await eventually(lambda: bool(new()), 40, poll_s=0.02)
            pid = new()[0]
            seen.add(pid)
            return pid

        os.kill(next(iter(seen)), signal.SIGKILL)  # served less than a minute: a failure
        second = await replacement()
        assert await eventually(lambda: _serving_workers(server) == 3, 30)
        os.kill(second, signal.SIGKILL)
        os.kill(third := await replacement(), signal.SIGSTOP)
        assert await eventually(lambda: bool(server.logged("worker_restart_failed")), 20)
        await replacement()
        assert await eventually(lambda: _serving_workers(server) == 4, 30)
        answers = await _rerank_on_new_connections(server.port, 16)
        async with httpx.AsyncClient() as http:
            metrics = (await http.get(f"http://127.0.0.1:{server.metrics_port}/metrics")).text
    exits = server.logged("worker_exited")
    assert [e["restarting_in_s"] for e in exits] == [1.0, 2.0]
    assert exits[0]["worker"] == exits[1]["worker"]
    [stuck] = server.logged("worker_restart_failed")
    assert stuck["restarting_in_s"] == 4.0 and "did not listen within 8 s" in stuck["error"]
    with pytest.raises(ProcessLookupError):
        os.kill(third, 0)
    assert all(a.reranked for a in answers)
    assert supervisor_samples(metrics, "rerank_worker_restarts_total") == [3.0]


def _serving_workers(server: Supervised) -> int:
    """How many times a worker has logged that it listens (first ones and replacements)."""
    return sum(e.get("event") == "serving" and "worker" in e for e in server.events)


def supervisor_samples(text: str, name: str) -> list[float]:
    """The values of the samples called `name` that carry no `worker` label."""
    return [
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and "worker" not in s.labels
    ]


@pytest.mark.parametrize(
    ("flag", "shared"),
    [("--port", False), ("--metrics-port", False), ("--port", True), ("--http-port", True)],
)
def test_a_port_in_use_is_one_line_naming_the_flag(
    fake_llama: FakeLlamaServer, flag: str, shared: bool
) -> None:
    """`shared`: the port's holder set SO_REUSEPORT (a gRPC server on default options,
    another rerank-server's workers), which the workers' own reservation would have
    joined, splitting the port's connections between the two programs."""
    ports = {"--port": "0", "--metrics-port": "0", "--http-port": "0"}
    with _listening(shared) as taken:
        ports[flag] = str(taken)
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "rerank_server",
                "--workers",
                "2",
                "--backend-url",
                fake_llama.url,
                *(x for kv in ports.items() for x in kv),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 2
    assert f"{flag} / RERANK_" in done.stderr and "Traceback" not in done.stderr


@contextlib.contextmanager
def _listening(shared: bool = False) -> Iterator[int]:
    import socket

    with socket.socket() as sock:
        if shared:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_concurrency_is_split_and_must_cover_every_worker() -> None:
    assert concurrency_shares(8, 3) == [3, 3, 2]
    assert concurrency_shares(4, 4) == [1, 1, 1, 1]
    with pytest.raises(ConfigError, match=r"--concurrency.*3 workers"):
        concurrency_shares(2, 3)
    assert worker_count(Settings(workers=3)) == 3


def test_one_worker_per_core_follows_a_containers_cpu_limit(tmp_path: Path) -> None:
    cores = len(os.sched_getaffinity(0))
    assert worker_count(Settings(workers=0), tmp_path) == cores  # no cgroup files: cores
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert worker_count(Settings(workers=0), tmp_path) == cores
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # 1.5 cores: two workers
    assert worker_count(Settings(workers=0), tmp_path) == min(cores, 2)
    (tmp_path / "cpu.max").write_text("50000 100000\n")
    assert worker_count(Settings(workers=0), tmp_path) == 1


def test_one_worker_per_core_stops_at_the_backend_slots(tmp_path: Path) -> None:
    """Each worker needs one of --concurrency's slots: more cores than slots is as many
    workers as slots (before: a refusal to start, on any node with more than 4 cores at
    the default --concurrency 4)."""
    cores = len(os.sched_getaffinity(0))
    assert worker_count(Settings(workers=0, concurrency=1), tmp_path) == 1
    count = worker_count(Settings(workers=0, concurrency=cores + 8), tmp_path)
    assert count == cores
    concurrency_shares(1, worker_count(Settings(workers=0, concurrency=1), tmp_path))
