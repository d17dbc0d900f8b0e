"""rerank-server as its own process, for tests that measure it from outside (RSS, exit
time, load from another process) or signal it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

from rerank_server.managed.llama_server import free_port


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
async def server_process(backend_url: str, **env: str,
                         ) -> AsyncIterator[tuple[int, subprocess.Popen[bytes]]]:
    """(gRPC port, process) of a server using `backend_url`, `env` added to its
    environment; terminated (SIGTERM) on exit if still running."""
    port = free_port()
    full = {**os.environ, "RERANK_PORT": str(port), "RERANK_HTTP_PORT": "0",
            "RERANK_METRICS_PORT": "0", "RERANK_BACKEND_URL": backend_url,
            "RERANK_LOG_LEVEL": "warning", **env}
    # Popen returns at once; callers await everything that waits on the process.
    proc = subprocess.Popen([sys.executable, "-m", "rerank_server"], env=full,  # noqa: ASYNC220
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        await wait_listening(port, proc)
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
