"""Processes a benchmark runs: rerank-server, the instant fake backend, llama-server.

Each in a process of its own, so its CPU time read from `/proc` is its alone.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from ..managed import assets, foreground, llama_build
from ..managed.child_process import free_port
from ..managed.foreground import stop, wait_healthy
from ..managed.llama_server import RAM_CACHE_OFF
from ..settings import load


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks  # utime, stime


def cpu_ns(pid: int) -> int:
    """CPU time of every live thread of `pid` so far, in nanoseconds (schedstat: finer
    than `cpu_seconds`'s clock ticks of 10 ms)."""
    return sum(
        int((task / "schedstat").read_text().split()[0])
        for task in Path(f"/proc/{pid}/task").iterdir()
    )


def _wait_port(
    port: int, proc: subprocess.Popen[bytes], timeout_s: float = 30, name: str = "rerank-server"
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{name} did not start listening")


@contextmanager
def fake_backend(latency_ms: float = 0.0) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rerank_server.bench.fake_backend",
            "--port",
            str(port),
            "--latency-ms",
            str(latency_ms),
        ]
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


@contextmanager
def bare_grpc() -> Iterator[tuple[int, int]]:
    """(port, PID) of a bare `grpc.aio` server answering `Rerank` (`bare_grpc.py`)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "rerank_server.bench.bare_grpc", "--port", str(port)]
    )
    try:
        _wait_port(port, proc, name="the bare gRPC server")
        yield port, proc.pid
    finally:
        stop(proc)


def start_server(
    args: Sequence[str],
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    prefix: Sequence[str] = (),
    start_timeout_s: float = 30,
) -> tuple[int, subprocess.Popen[bytes]]:
    """A rerank-server started with `args` (cache and metrics off unless `args` say
    otherwise), listening: its gRPC port and process. `env` adds variables; `cwd` is where
    `python -m rerank_server` finds the package first (another checkout, for A/B runs);
    `prefix` runs it under another program (valgrind, for instruction counts)."""
    port = free_port()
    environ = {
        **os.environ,
        "RERANK_PORT": str(port),
        "RERANK_CACHE_ENTRIES": "0",
        "RERANK_HTTP_PORT": "0",
        "RERANK_METRICS": "0",
        "RERANK_PROBE": "0",
        "RERANK_LOG_LEVEL": "warning",
        **(env or {}),
    }
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-m", "rerank_server", *args],
        env=environ,
        stdout=subprocess.DEVNULL,
        cwd=cwd,
    )
    try:
        _wait_port(port, proc, start_timeout_s)
    except BaseException:
        stop(proc)
        raise
    return port, proc


@contextmanager
def rerank_server(args: Sequence[str]) -> Iterator[tuple[int, int]]:
    """(gRPC port, PID) of a rerank-server started with `args` (`start_server`)."""
    port, proc = start_server(args)
    try:
        yield port, proc.pid
    finally:
        stop(proc)


@contextmanager
def llama_server(slots: int, extra: Sequence[str] = ()) -> Iterator[str]:
    """The cached llama-server build with the stand-in model (from `make assets`);
    `extra`: more llama-server arguments."""
    settings = load([])  # RERANK_CACHE_DIR and RERANK_LLAMA_AMX, as `prepare` reads them
    cache = settings.cache_dir
    binary = llama_build.resolve_llama_server(None, cache, build=False, amx_mode=settings.llama_amx)
    model = assets.resolve_stand_in(cache, fetch_missing=False)
    # As managed mode runs it: without the host-memory prompt cache, which grows toward
    # its 8 GiB bound over a run and slows every task as it grows (docs/decisions.md).
    args = ["-np", str(slots), "-c", str(slots * 2048), *RAM_CACHE_OFF, *extra]
    with foreground.llama_server(
        binary, model, args, cache=cache, amx_mode=settings.llama_amx
    ) as served:
        yield served.url
