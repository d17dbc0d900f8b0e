"""A backend that accepts calls and never answers, while its /health still says ok.

Promises (docs/reliability.md): the backend never sees more than --concurrency calls;
after a few calls get no answer the instance is ejected and requests degrade at once
instead of waiting for their deadline; `rerank.v1.Reranker/backend` says NOT_SERVING; once
the backend answers again, reranked answers are back within 5 s.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from grpc_health.v1 import health_pb2

from rerank_server.api.grpc_server import BACKEND_HEALTH
from rerank_server.scoring import monitor
from rerank_server.server import RunningServer
from tests.conftest import StartServer, client_of
from tests.fakes.llama import HANG, FakeLlamaServer
from tests.waiting import eventually

DOCS = ["alpha", "beta", "gamma", "delta"]


async def backend_status(server: RunningServer) -> int:
    reply = await server.edge.health.Check(
        health_pb2.HealthCheckRequest(service=BACKEND_HEALTH), None
    )
    return int(reply.status)


@pytest.mark.usefixtures("frozen_heap")  # it times answers to a quarter of a second
async def test_hung_backend_is_ejected_then_recovers_within_5_s(
    start_server: StartServer, fake_llama: FakeLlamaServer
) -> None:
    server = await start_server(concurrency=2, health_interval_s=0.5)
    async with client_of(server) as client:
        assert (await client.rerank("warm up", DOCS, timeout=5)).reranked
        fake_llama.mode = HANG
        durations, answers = [], []
        started = time.monotonic()
        while time.monotonic() - started < 8:
            t0 = time.monotonic()
            answer = await client.rerank(f"q {t0}", DOCS, timeout=1.0)
            durations.append(time.monotonic() - t0)
            answers.append(answer)
        assert not any(a.reranked for a in answers)
        assert all(d < 1.0 for d in durations), "an answer came after its deadline"
        # Ejected: the later answers come at once, and say the backend is unavailable.
        assert max(durations[-10:]) < 0.25, durations[-10:]
        assert answers[-1].summary.degraded_code == "backend_unavailable"
        assert await backend_status(server) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert fake_llama.max_in_flight <= 2, "more calls than --concurrency reached it"

        fake_llama.unhang()
        fixed = time.monotonic()
        while not (await client.rerank(f"after {time.monotonic()}", DOCS, timeout=1.0)).reranked:
            assert time.monotonic() - fixed < 5, "reranking did not come back within 5 s"
            await asyncio.sleep(0.1)
        back_s = time.monotonic() - fixed
    waited = [round(d, 2) for d in durations[:4]]
    print(
        f"hung: {len(answers)} answers, first waits {waited} s, last 10 max "
        f"{max(durations[-10:]) * 1000:.0f} ms, backend max in flight "
        f"{fake_llama.max_in_flight}, reranked again {back_s:.1f} s after the fix"
    )
    # The health name follows at once: the restore wakes the monitor.
    serving = health_pb2.HealthCheckResponse.SERVING

    async def is_serving() -> bool:
        return await backend_status(server) == serving

    assert await eventually(is_serving, 1)


@pytest.mark.parametrize(("before_s", "after_s"), [(0.3, 0.8), (0.05, 1.5)])
async def test_a_slow_but_alive_backend_comes_back_after_ejection(
    start_server: StartServer,
    fake_llama: FakeLlamaServer,
    monkeypatch: pytest.MonkeyPatch,
    before_s: float,
    after_s: float,
) -> None:
    """It answered in `before_s`, hung until ejected, and now answers in `after_s`,
    longer than the fixed probe window (5 s in production, 0.5 s here).

    - 0.3 -> 0.8 s: the re-admission probe waits as long as a real call would be given
      (the leash, 1.2 s from the latency the instance showed before it hung), so the
      instance comes back instead of staying ejected while it is merely slow.
    - 0.05 -> 1.5 s: a window sized by its old pace (the leash's 1 s floor) never saw
      an answer, and no answered call could teach the new one: the instance stayed out
      for good although requests with a budget of seconds would have been served. Each
      failed probe in a row now doubles the window."""
    monkeypatch.setattr(monitor, "INSTANCE_PROBE_TIMEOUT_S", 0.5)
    fake_llama.latency_s = before_s
    server = await start_server(
        concurrency=4, health_interval_s=0.5, eject_base_s=0.5, eject_max_s=1.0
    )
    async with client_of(server) as client:
        assert (await client.rerank("warm up", DOCS, timeout=10)).reranked
        fake_llama.mode = HANG
        answer = await client.rerank("hung", DOCS, timeout=1.0)
        while answer.summary.degraded_code != "backend_unavailable":
            answer = await client.rerank(f"hung {time.monotonic()}", DOCS, timeout=1.0)
        fake_llama.latency_s = after_s  # answers again, but slower than the probe window
        fake_llama.unhang()

        async def reranked() -> bool:
            return (await client.rerank(f"q {time.monotonic()}", DOCS, timeout=8)).reranked

        assert await eventually(reranked, 20, poll_s=0.5), "a slow instance was never re-admitted"
