"""What the server opens is closed exactly once, in order, on every path; requests cannot
raise the operator's caps."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from pathlib import Path

import psutil
import pytest

from rerank_server.api import grpc_server
from rerank_server.errors import BindError
from rerank_server.managed.child_process import free_port
from rerank_server.server import build_server
from rerank_server.settings import Settings
from tests.conftest import StartServer, client_of
from tests.fakes.llama import FakeLlamaServer
from tests.fakes.scorer import FunctionScorer


def _can_bind(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _open_files_under(folder: Path) -> list[str]:
    """Files under `folder` this process holds open (Linux /proc)."""
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
    return [t for t in targets if t.startswith(str(folder))]


async def test_failed_bind_closes_everything_it_opened(
    tmp_path: Path, fake_llama: FakeLlamaServer
) -> None:
    metrics_port = free_port()
    scorer = FunctionScorer()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        settings = Settings(
            port=taken.getsockname()[1],
            metrics_port=metrics_port,
            http_port=0,
            backend_url=fake_llama.url,
            probe=False,
            cache_path=str(tmp_path / "scores.sqlite"),
        )
        with pytest.raises(BindError, match="--port / RERANK_PORT"):
            await build_server(settings, scorer=scorer)
    assert scorer.closed == 1
    assert _can_bind(metrics_port), "the metrics endpoint outlived the failed start"
    assert not _open_files_under(tmp_path), "the SQLite score cache was left open"


async def test_stop_closes_once_even_when_called_twice(fake_llama: FakeLlamaServer) -> None:
    scorer = FunctionScorer()
    settings = Settings(
        port=0, http_port=0, metrics_port=0, backend_url=fake_llama.url, probe=False
    )
    running = await build_server(settings, scorer=scorer)
    metrics_port = running.telemetry.metrics_port
    assert metrics_port is not None
    await running.stop(grace=0)
    await running.stop(grace=0)
    assert scorer.closed == 1
    assert _can_bind(metrics_port) and _can_bind(running.port)


async def test_a_request_cannot_raise_max_candidates(start_server: StartServer) -> None:
    server = await start_server(max_candidates=3)
    docs = [f"document {i}" for i in range(8)]
    async with client_of(server) as client:
        raised = await client.rerank("q", docs, max_candidates=6)
        lowered = await client.rerank("q", docs, max_candidates=2)
    assert raised.summary.submitted == 3 and len(raised.results) == 8
    assert lowered.summary.submitted == 2


async def test_a_busy_connection_is_renewed_by_age(
    start_server: StartServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection older than `CONNECTION_AGE_S` gets GOAWAY: the client's next calls go
    on a new connection (a new local port), so a busy client reaches pods added since;
    every call is answered."""
    monkeypatch.setattr(grpc_server, "CONNECTION_AGE_S", 1.0)
    server = await start_server()
    ports = set()
    async with client_of(server) as client:
        for _ in range(12):
            assert (await client.rerank("q", ["a", "b", "c"])).reranked
            ports |= {
                c.laddr.port
                for c in psutil.Process().net_connections("tcp")
                if c.raddr and c.raddr.port == server.port and c.status == "ESTABLISHED"
            }
            await asyncio.sleep(0.25)
    assert len(ports) >= 2, ports
