"""rerank-server as its own process, for tests that measure it from outside (RSS, exit
time, load from another process) or signal it, and with `--workers` under its supervisor."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from rerank_server.managed.child_process import free_port
from tests.waiting import eventually


async def wait_listening(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            await asyncio.sleep(0.1)
    raise AssertionError("server did not start listening")


@contextlib.asynccontextmanager
async def server_process(
    backend_url: str,
    **env: str,
) -> AsyncIterator[tuple[int, subprocess.Popen[bytes]]]:
    """(gRPC port, process) of a server using `backend_url`, `env` added to its
    environment, once every port it was given listens (the JSON edge starts after the
    gRPC one); terminated (SIGTERM) on exit if still running."""
    port = free_port()
    full = {
        **os.environ,
        "RERANK_PORT": str(port),
        "RERANK_HTTP_PORT": "0",
        "RERANK_METRICS_PORT": "0",
        "RERANK_BACKEND_URL": backend_url,
        "RERANK_LOG_LEVEL": "warning",
        **env,
    }
    # Popen returns at once; callers await everything that waits on the process.
    proc = subprocess.Popen(  # noqa: ASYNC220
        [sys.executable, "-m", "rerank_server"],
        env=full,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        await wait_listening(port, proc)
        if int(full["RERANK_HTTP_PORT"]):
            await wait_listening(int(full["RERANK_HTTP_PORT"]), proc)
        yield port, proc
    finally:
        await stop_process(proc, 15)


async def stop_process(proc: subprocess.Popen[Any], grace_s: float) -> None:
    """SIGTERM `proc` if it still runs, SIGKILL it after `grace_s`, and reap it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            await asyncio.to_thread(proc.wait, grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    await asyncio.to_thread(proc.wait)


class Supervised:
    """A `rerank-server --workers N` process whose JSON log lines are collected."""

    def __init__(
        self, proc: subprocess.Popen[str], port: int, http_port: int, metrics_port: int
    ) -> None:
        self.proc = proc
        self.port, self.http_port, self.metrics_port = port, http_port, metrics_port
        self.events: list[dict[str, Any]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                try:
                    self.events.append(json.loads(line))
                except ValueError as exc:  # lines of two workers ran into each other
                    raise AssertionError(f"not one JSON object: {line!r}") from exc

    def close(self) -> None:
        self._reader.join(10)
        assert self.proc.stdout is not None
        self.proc.stdout.close()

    def logged(self, event: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == event]

    def workers(self) -> list[int]:
        """PIDs of the worker processes now (the supervisor's children but the
        multiprocessing resource tracker)."""
        return self.children(b"spawn_main")

    def children(self, marker: bytes) -> list[int]:
        """PIDs of the supervisor's children whose command line holds `marker`."""
        pids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError):
                # pid (comm) state ppid ...: comm may hold spaces, so split after it.
                fields = stat.read_text().rsplit(")", 1)[1].split()
                cmdline = (stat.parent / "cmdline").read_bytes()
                if int(fields[1]) == self.proc.pid and marker in cmdline:
                    pids.append(int(stat.parent.name))
        return pids


@contextlib.asynccontextmanager
async def supervised(
    backend_url: str | None, workers: int = 2, start_timeout_s: float = 60, **env: str
) -> AsyncIterator[Supervised]:
    """`rerank-server --workers N` as a user runs it; with no `backend_url`, in managed
    mode (its own llama-server from the asset cache)."""
    port, http_port, metrics_port = free_port(), free_port(), free_port()
    backend = {"RERANK_BACKEND_URL": backend_url} if backend_url else {"RERANK_MANAGED": "1"}
    full = {
        **os.environ,
        "RERANK_PORT": str(port),
        "RERANK_HTTP_PORT": str(http_port),
        "RERANK_METRICS_PORT": str(metrics_port),
        **backend,
        "RERANK_WORKERS": str(workers),
        "RERANK_PROBE": "0",
        "RERANK_LOG_FORMAT": "json",
        "RERANK_LOG_LEVEL": "info",
        **env,
    }
    # Popen returns at once; the test awaits everything that waits on the process.
    # A session of its own, as in a terminal: the test can signal the whole group.
    proc = subprocess.Popen(  # noqa: ASYNC220
        [sys.executable, "-m", "rerank_server"],
        env=full,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    server = Supervised(proc, port, http_port, metrics_port)
    try:
        # Under a supervisor, its own line (with `workers`) says all of them listen.
        started = await eventually(
            lambda: (
                any(workers == 1 or "workers" in e for e in server.logged("serving"))
                or proc.poll() is not None
            ),
            start_timeout_s,
        )
        assert started, server.events
        assert proc.poll() is None, server.events
        yield server
    finally:
        await stop_process(proc, 20)
        server.close()
