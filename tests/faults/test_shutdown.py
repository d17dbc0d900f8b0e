"""SIGTERM while requests wait on a hung backend: every in-flight RPC gets a degraded
answer before the grace period ends, and the process exits within grace + 1 s."""

from __future__ import annotations

import asyncio
import signal
import time

from rerank_client import AsyncRerankClient

from tests.fakes.llama import HANG, FakeLlamaServer
from tests.server_process import server_process
from tests.waiting import eventually

GRACE_S = 3.0


async def test_sigterm_with_a_hung_backend_answers_in_flight_and_exits_in_time(
    fake_llama: FakeLlamaServer,
) -> None:
    fake_llama.mode = HANG
    async with (
        server_process(
            fake_llama.url,
            RERANK_PROBE="0",
            RERANK_GRACE_PERIOD_S=str(GRACE_S),
            RERANK_TIMEOUT_MS="60000",
            RERANK_CONCURRENCY="8",
        ) as (port, proc),
        AsyncRerankClient(f"127.0.0.1:{port}") as client,
    ):
        calls = [
            asyncio.ensure_future(client.rerank(f"q{i}", ["a", "b", "c"], timeout=30))
            for i in range(8)
        ]
        assert await eventually(lambda: fake_llama.in_flight >= 8, 5)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        answers = await asyncio.gather(*calls)
        answered = time.monotonic() - signalled
        code = await asyncio.to_thread(proc.wait, GRACE_S + 5)
        exited = time.monotonic() - signalled
    print(
        f"shutdown: 8 in-flight answered {answered:.2f} s after SIGTERM "
        f"({answers[0].summary.degraded_code}), exited after {exited:.2f} s, grace {GRACE_S} s"
    )
    assert code == 0
    assert all(not a.reranked and a.summary.degraded_code == "shutting_down" for a in answers)
    assert answered < GRACE_S, f"answers came {answered:.1f} s after SIGTERM"
    assert exited < GRACE_S + 1, f"exited {exited:.1f} s after SIGTERM"
