"""`rerank-server --managed --workers 2` as a user runs it: the supervisor runs the one
llama-server (the cached stand-in, as `make run` uses), every worker scores with it, its
restarts are counted on the merged `/metrics`, and nothing is left running after SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from rerank_client import AsyncRerankClient

from tests.real.conftest import assets_or_fail
from tests.server_process import Supervised, supervised
from tests.waiting import eventually

DOCS = ["Cats eat meat.", "The stock market fell.", "Kittens need milk.", "Rain in Spain."]


async def _rerank_on_new_connections(port: int, count: int) -> list[Any]:
    """`count` requests at once, each on its own channel (so both workers get some); every
    pair is sent (`always_score`: the stand-in's blend profile gives it no weight)."""

    async def one(i: int) -> Any:
        async with AsyncRerankClient(f"127.0.0.1:{port}", own_connection=True) as client:
            return await client.rerank(
                f"what do cats eat {i}?", DOCS, always_score=True, bypass_cache=True, timeout=60
            )

    return await asyncio.gather(*(one(i) for i in range(count)))


async def _llama_restarts(server: Supervised) -> list[float]:
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"http://127.0.0.1:{server.metrics_port}/metrics")).text
    return [
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "rerank_llama_server_restarts_total" and "worker" not in s.labels
    ]


async def test_managed_workers_share_one_llama_server_that_restarts_and_stops() -> None:
    assets_or_fail()
    # A scoring budget far above what the stand-in needs on a slow 2-core machine: this
    # test is about processes, not speed.
    async with supervised(
        None, workers=2, start_timeout_s=180, RERANK_TIMEOUT_MS="60000"
    ) as server:
        llamas = server.children(b"llama-server")
        assert len(llamas) == 1, "one llama-server for every worker, run by the supervisor"
        answers = await _rerank_on_new_connections(server.port, 16)
        assert all(a.reranked and a.summary.scored == len(DOCS) for a in answers)
        # A worker logs its call before answering, but the log reader may lag behind.
        assert await eventually(lambda: len(server.logged("rpc")) >= 16, 10)
        assert {e["worker"] for e in server.logged("rpc")} == {0, 1}
        assert await _llama_restarts(server) == [0.0]

        os.kill(llamas[0], signal.SIGKILL)
        assert await eventually(
            lambda: (
                len(server.children(b"llama-server")) == 1
                and llamas[0] not in server.children(b"llama-server")
            ),
            30,
        )
        assert await eventually(lambda: bool(server.logged("llama_server_ready")), 120)
        again = await _rerank_on_new_connections(server.port, 4)
        assert all(a.reranked for a in again)
        assert await _llama_restarts(server) == [1.0]
        last = server.children(b"llama-server")
        # Both runs' output is in the one file their start lines name (by the supervisor's
        # PID, not llama-server's): two "listening" lines, one per run.
        logs = {e["log"] for e in server.logged("llama_server_started")}
        assert len(server.logged("llama_server_started")) == 2 and len(logs) == 1
        output = await asyncio.to_thread(Path(logs.pop()).read_bytes)
        assert output.count(b"listening on http://127.0.0.1") == 2
    assert server.proc.returncode == 0
    with pytest.raises(ProcessLookupError):
        os.kill(last[0], 0)
