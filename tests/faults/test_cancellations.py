"""Clients that give up mid-call, thousands of times: abandoned backend calls stay within
--concurrency, end on their own, and leave the healthy backend in service."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Mapping
from typing import Any

import pytest
from grpc_health.v1 import health_pb2
from rerank_client import AsyncRerankClient

from rerank_server.api.grpc_server import BACKEND_HEALTH
from rerank_server.scoring import budget
from rerank_server.scoring.base import Emit, ScoreRequest
from rerank_server.scoring.calls import CallTasks
from rerank_server.scoring.transport import backend as http_module
from tests.conftest import StartServer, client_of
from tests.fakes.json_server import JsonServer
from tests.fakes.llama import EXCEEDS_CONTEXT, HANG, OK, FakeLlamaServer
from tests.fakes.rerank_api import FakeRerankApi
from tests.waiting import eventually

DOCS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"]


async def _churn(
    client: AsyncRerankClient,
    docs: list[str],
    until: float,
    rng: random.Random,
    after_s: tuple[float, float],
) -> int:
    """Send `Rerank` after `Rerank` until `until`, each cancelled (the client goes away:
    grpc cancels the RPC) a random `after_s` in unless already answered; how many were."""
    cancelled = 0
    while time.monotonic() < until:
        call = asyncio.ensure_future(client.rerank(f"q {rng.random()}", docs))
        await asyncio.sleep(rng.uniform(*after_s))
        if not call.done():
            call.cancel()
            cancelled += 1
        await asyncio.gather(call, return_exceptions=True)
    return cancelled


async def test_client_cancellations_neither_pile_up_nor_eject_a_healthy_backend(
    start_server: StartServer, fake_llama: FakeLlamaServer
) -> None:
    fake_llama.latency_s = 0.1
    server = await start_server(concurrency=4, health_interval_s=0.5)
    rng = random.Random(7)

    async with client_of(server) as client:
        until = time.monotonic() + 4
        counts = await asyncio.gather(
            *(_churn(client, DOCS, until, rng, (0.01, 0.12)) for _ in range(24))
        )
        cancelled = sum(counts)
        assert cancelled > 300, cancelled
        assert fake_llama.max_in_hand <= 4, "abandoned calls went past --concurrency"
        http = server.pool.endpoints[0].http
        assert await eventually(
            lambda: http.abandoned == 0 and not _tracked(server.pool.calls), 3
        ), "abandoned calls did not end, or their tasks stayed registered"
        assert server.pool.endpoints[0].available, "a healthy backend was taken out"
        answers = [await client.rerank(f"normal {i}", DOCS, timeout=5) for i in range(20)]
    assert all(a.reranked and a.summary.failed == 0 for a in answers)
    print(
        f"cancellations: {cancelled} in 4 s, backend max in hand "
        f"{fake_llama.max_in_hand} (--concurrency 4), 20/20 reranked afterwards"
    )
    reply = await server.edge.health.Check(
        health_pb2.HealthCheckRequest(service=BACKEND_HEALTH), None
    )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def _tracked(calls: CallTasks) -> list[object]:
    """What the one-task-per-pair bookkeeping (`CallTasks`) still holds."""
    return calls.held()


async def test_a_pair_let_go_makes_no_further_call(
    start_server: StartServer, fake_llama: FakeLlamaServer
) -> None:
    """A per-pair call runs in its pair's own task. When the request stops waiting, a call
    on the wire is abandoned, not cancelled; when it then comes back "too long", the pair
    must not try again with a shorter document: nobody waits for it."""
    # Answered after the request's deadline, within the leash (2 s while no latency is
    # known): the answer comes back to a pair nobody waits for.
    fake_llama.latency_s = 1.5
    fake_llama.mode = EXCEEDS_CONTEXT
    server = await start_server(concurrency=4)
    docs = [f"{name} " * 100 for name in DOCS[:3]]
    async with client_of(server) as client:
        answer = await client.rerank("q", docs, timeout=0.6)
    assert not answer.reranked and answer.summary.degraded_code == "timeout"
    http = server.pool.endpoints[0].http
    assert http.abandoned == 3  # on the wire when the request gave up
    assert await eventually(lambda: http.abandoned == 0, 3), "abandoned calls did not end"
    await asyncio.sleep(0.5)  # time for a second try (answered at once), were one made
    assert len(fake_llama.requests) == 3, "a pair let go called the backend again"
    assert not _tracked(server.pool.calls)


async def test_a_batched_call_is_abandoned_on_its_leash_when_the_budget_runs_out(
    start_server: StartServer,
) -> None:
    """A batching scorer makes its one call in the scorer's own task (no task and shield
    of its own): when the request's budget runs out, that task is let go, so the call on
    the wire is abandoned, not cancelled. It keeps its slot until it ends within the
    leash, the request answers in retrieval order in time, and nothing stays tracked."""
    # Past the request's deadline, within the leash (2 s).
    fake = FakeRerankApi(latency_s=1.0).start()
    try:
        server = await start_server(backend="rerank", backend_url=fake.url)
        http = server.pool.endpoints[0].http
        async with client_of(server) as client:
            # An answer at all is in time: past its deadline the call would fail.
            answer = await client.rerank("q", DOCS, timeout=0.5)
        assert not answer.reranked and answer.summary.degraded_code == "timeout"
        assert http.abandoned == 1 and len(http._calls) == 1, "the call was not abandoned"
        assert await eventually(lambda: http.abandoned == 0 and not http._calls, 3), (
            "the abandoned call did not end within its leash"
        )
        assert len(fake.posts("/v1/rerank")) == 1
        assert not _tracked(server.pool.calls)
    finally:
        fake.stop()


async def test_a_scorer_let_go_mid_call_goes_no_further() -> None:
    """A scorer's task let go while its own call is on the wire (a `completion` scorer's
    `/apply-template`, say) stops when that call comes back within the leash: it starts
    no scoring calls in tasks of its own, which nobody would let go, and leaves nothing
    tracked, not even for the leash's timer."""

    def slow(
        method: str,
        path: str,
        body: Any,
        headers: Mapping[str, str],
    ) -> tuple[int, Any]:
        time.sleep(0.3)
        return 200, {"ok": True}

    class TwoStepScorer:
        kind, model = "test", ""

        @property
        def calls(self) -> CallTasks:
            return backend.calls

        async def score(self, request: ScoreRequest, emit: Emit) -> None:
            await backend.post_json("/meta", {}, pairs=0)
            async with asyncio.TaskGroup() as group:  # slices, as a batching scorer's
                for n in range(2):
                    group.create_task(backend.post_json("/score", {"n": n}))

    fake = JsonServer(slow).start()
    backend = http_module.HttpBackend(fake.url, 4, 10.0)
    try:
        task = asyncio.create_task(
            budget._scoring(TwoStepScorer(), ScoreRequest("q", "", ["d"]), lambda _: None)
        )  # type: ignore[arg-type]
        await asyncio.sleep(0.1)  # its own call is on the wire
        await budget._stop(task, backend.calls)  # the request stops waiting
        assert backend.abandoned == 1
        assert await eventually(lambda: task.done() and backend.abandoned == 0, 3)
        await asyncio.sleep(0.5)  # time for the scoring calls, were they made
        assert fake.posts("/score") == []
        assert not backend._given_up and not backend._calls and not _tracked(backend.calls)
    finally:
        await backend.aclose()
        fake.stop()


@pytest.mark.parametrize(
    ("latency_s", "mode", "deadline_s"),
    [
        (0.1, OK, None),  # quick calls, clients cancelling at random
        (2.0, OK, 0.5),  # calls slower than every caller's deadline
        (0.0, HANG, 0.5),  # a backend that takes calls and never answers
    ],
)
async def test_a_cancellation_storm_never_gives_the_backend_more_than_concurrency(
    start_server: StartServer,
    fake_llama: FakeLlamaServer,
    latency_s: float,
    mode: str,
    deadline_s: float | None,
) -> None:
    """A model server goes on working on a call whose client hung up, so a slot given back
    when the connection closes is one the backend still fills: the backend's own count of
    calls in hand must stay within --concurrency however clients give up."""
    fake_llama.latency_s, fake_llama.mode = latency_s, mode
    server = await start_server(concurrency=4, health_interval_s=0.5)
    rng = random.Random(11)
    gave_up = answered = 0

    async def churn(client: AsyncRerankClient, until: float) -> None:
        nonlocal gave_up, answered
        while time.monotonic() < until:
            call = asyncio.ensure_future(
                client.rerank(f"q {rng.random()}", DOCS, timeout=deadline_s)
            )
            if deadline_s is None:
                await asyncio.sleep(rng.uniform(0.01, 0.12))
                if not call.done():
                    call.cancel()
            outcome = (await asyncio.gather(call, return_exceptions=True))[0]
            if isinstance(outcome, BaseException) or not outcome.reranked:
                gave_up += 1  # the client, or the server at the deadline, stopped waiting
            else:
                answered += 1

    try:
        async with client_of(server) as client:
            await asyncio.gather(*(churn(client, time.monotonic() + 4) for _ in range(24)))
    finally:
        fake_llama.unhang()
    print(
        f"latency {latency_s} s {mode}: {gave_up} given up, {answered} answered, backend "
        f"max in hand {fake_llama.max_in_hand} (--concurrency 4)"
    )
    assert gave_up > 20
    assert fake_llama.max_in_hand <= 4, "the backend was handed more than --concurrency"


async def test_cancelled_calls_over_four_channels_never_give_the_backend_more_than_concurrency(
    start_server: StartServer, fake_llama: FakeLlamaServer
) -> None:
    """32 clients over 4 channels, each `Rerank` of 10 candidates cancelled 20-120 ms after
    it was sent, a backend that takes 100 ms a call and finishes a call whose caller hung
    up: counted as the backend counts (from the body read to the answer ready), it never
    holds more than --concurrency calls."""
    fake_llama.latency_s = 0.1
    server = await start_server(concurrency=4, health_interval_s=0.5)
    docs = [f"candidate {i}" for i in range(10)]
    rng = random.Random(13)
    channels = [client_of(server, own_connection=True) for _ in range(4)]
    try:
        until = time.monotonic() + 4
        counts = await asyncio.gather(
            *(_churn(channels[i % 4], docs, until, rng, (0.02, 0.12)) for i in range(32))
        )
        cancelled = sum(counts)
    finally:
        for channel in channels:
            await channel.close()
    http = server.pool.endpoints[0].http
    assert await eventually(lambda: http.abandoned == 0 and not http._calls, 3)
    print(
        f"4 channels, 32 clients: {cancelled} cancelled, {len(fake_llama.requests)} calls, "
        f"backend max in hand {fake_llama.max_in_hand} (--concurrency 4)"
    )
    assert cancelled > 300, cancelled
    assert fake_llama.max_in_hand <= 4, "the backend was handed more than --concurrency"
