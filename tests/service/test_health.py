"""grpc.health.v1 and reflection: main service, backend sub-services, draining."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from rerank_server.scoring import monitor
from rerank_server.server import build_server
from rerank_server.settings import Settings
from tests.fakes.llama import FakeLlamaServer
from tests.waiting import eventually

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def _status(channel: grpc.aio.Channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return (await stub.Check(health_pb2.HealthCheckRequest(service=service))).status


async def test_health_backend_probe_and_draining(fake_llama: FakeLlamaServer) -> None:
    fake_llama.scores = {"Paris": 0.95, "Photosynthesis": 0.02}
    settings = Settings(port=0, http_port=0, backend_url=fake_llama.url, health_interval_s=0.1)
    server = await build_server(settings)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        await server.monitor.probed.wait()
        assert await _status(channel, "") == SERVING
        assert await _status(channel, "rerank.v1.Reranker") == SERVING
        assert await _status(channel, "rerank.v1.Reranker/backend") == SERVING
        assert await _status(channel, "rerank.v1.Reranker/backend/discriminates") == SERVING
        await server.edge.health.enter_graceful_shutdown()
        assert await _status(channel, "rerank.v1.Reranker") == NOT_SERVING
    await server.stop(grace=0)


async def test_indistinct_model_is_flagged_but_main_service_serves(
    fake_llama: FakeLlamaServer,
) -> None:
    fake_llama.default_score = 0.5  # same score for every document
    settings = Settings(port=0, http_port=0, backend_url=fake_llama.url, health_interval_s=0.1)
    server = await build_server(settings)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        await server.monitor.probed.wait()
        assert await _status(channel, "rerank.v1.Reranker") == SERVING
        assert await _status(channel, "rerank.v1.Reranker/backend") == SERVING
        assert await _status(channel, "rerank.v1.Reranker/backend/discriminates") == NOT_SERVING
    await server.stop(grace=0)


async def test_reflection_lists_services_and_can_be_turned_off(fake_llama: FakeLlamaServer) -> None:
    base = Settings(port=0, http_port=0, backend_url=fake_llama.url, probe=False)
    for enabled in (True, False):
        server = await build_server(dataclasses.replace(base, reflection=enabled))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            call = stub.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")])
            )
            try:
                names = [s.name async for r in call for s in r.list_services_response.service]
            except grpc.aio.AioRpcError as exc:
                assert not enabled and exc.code() == grpc.StatusCode.UNIMPLEMENTED
            else:
                assert enabled and "rerank.v1.Reranker" in names
        await server.stop(grace=0)


async def test_a_probe_that_failed_once_is_tried_again(
    fake_llama: FakeLlamaServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe as the backend comes up failing once (a hiccup) left `backend`
    NOT_SERVING for as long as the pool stayed up, while requests reranked: dashboards
    and alerts saw a dead backend. It is tried again until it scores."""
    monkeypatch.setattr(monitor, "REPROBE_S", 0.2)
    fake_llama.scores = {"Paris": 0.95, "Photosynthesis": 0.02}
    fake_llama.failing_markers = ("Paris", "Photosynthesis")
    settings = Settings(port=0, http_port=0, backend_url=fake_llama.url, health_interval_s=0.1)
    server = await build_server(settings)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        await server.monitor.probed.wait()
        assert await _status(channel, "rerank.v1.Reranker/backend") == NOT_SERVING
        fake_llama.failing_markers = ()

        async def backend_serving() -> bool:
            return await _status(channel, "rerank.v1.Reranker/backend") == SERVING

        assert await eventually(backend_serving, 5)
        assert await _status(channel, "rerank.v1.Reranker/backend/discriminates") == SERVING
    await server.stop(grace=0)


async def test_watch_streams_the_status_and_its_changes(fake_llama: FakeLlamaServer) -> None:
    """Clients with client-side health checking (gRPC's `healthCheckConfig`) call
    `Watch`, not `Check`. The interceptor iterated it as an async generator, but
    grpc_health's Watch is a coroutine that writes: every call ended UNKNOWN. Open
    without a token, as `Check` is."""
    fake_llama.scores = {"Paris": 0.95, "Photosynthesis": 0.02}
    settings = Settings(
        port=0,
        http_port=0,
        backend_url=fake_llama.url,
        health_interval_s=0.1,
        auth_tokens="a-long-enough-s3cret-token",
    )
    server = await build_server(settings)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        await server.monitor.probed.wait()
        stub = health_pb2_grpc.HealthStub(channel)
        call = stub.Watch(health_pb2.HealthCheckRequest(service="rerank.v1.Reranker"), timeout=10)
        unknown = stub.Watch(health_pb2.HealthCheckRequest(service="nothing"), timeout=10)
        first = await call.read()
        assert first.status == SERVING
        assert (await unknown.read()).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        # The drain: NOT_SERVING, then the stream ends. grpc's stop waits for every open
        # call, and a Watch that never ended held it for the whole grace period.
        started = time.monotonic()
        stopping = asyncio.ensure_future(server.stop(grace=5))
        second = await call.read()
        assert second.status == NOT_SERVING
        assert await call.read() is grpc.aio.EOF
        await stopping
        took = time.monotonic() - started
    assert took < 2.5, f"an open Watch held the stop for {took:.1f} s"
