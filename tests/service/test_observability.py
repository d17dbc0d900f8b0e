"""Observability: the Prometheus endpoint moves as requests are served, load shedding is
counted, a traced request yields the documented span tree with no text in it, and the
canonical log line joins the trace."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.proto.collector.metrics.v1 import (
    metrics_service_pb2,
    metrics_service_pb2_grpc,
)
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from rerank_client import AsyncRerankClient, RerankError, ServerBusyError, Threshold

from rerank_server.managed.child_process import free_port
from rerank_server.observability.telemetry import Telemetry
from rerank_server.server import RunningServer, build_server
from rerank_server.settings import Settings
from tests.conftest import StartServer, client_of
from tests.fakes.llama import HTTP_500, FakeLlamaServer
from tests.scraped import moved, scrape, total
from tests.waiting import eventually

CANARY = "CANARY-91c2"
RERANK = "rerank.v1.Reranker/Rerank"


async def test_prometheus_counters_and_histograms_move(
    server: RunningServer, client: AsyncRerankClient, fake_llama: FakeLlamaServer
) -> None:
    docs = [f"document {i}" for i in range(6)]
    before = await scrape(server)
    await client.rerank("q", docs)
    await client.rerank("q", docs[:4], bypass_cache=True)
    fake_llama.mode = HTTP_500
    degraded = await client.rerank("q", docs, bypass_cache=True)
    assert not degraded.reranked
    after = await scrape(server)

    assert (
        moved(
            before,
            after,
            "rpc_server_call_duration_seconds_count",
            rpc_method=RERANK,
            rpc_response_status_code="OK",
        )
        == 3
    )
    assert (
        moved(
            before,
            after,
            "rerank_requests_total",
            rerank_reranked="true",
            rerank_degraded_reason="none",
            rerank_backend="chat",
        )
        == 2
    )
    assert (
        moved(
            before,
            after,
            "rerank_requests_total",
            rerank_reranked="false",
            rerank_degraded_reason="backend_error",
        )
        == 1
    )
    # 6, 4 and 6 candidates: all three land in the "<= 10" bucket, two above 5.
    assert moved(before, after, "rerank_request_candidates_count") == 3
    assert moved(before, after, "rerank_request_candidates_sum") == 16
    assert moved(before, after, "rerank_request_candidates_bucket", le="5.0") == 1
    assert moved(before, after, "rerank_request_candidates_bucket", le="10.0") == 3
    assert moved(before, after, "rerank_request_scored_pairs_sum") == 10
    assert moved(before, after, "rerank_pairs_total", rerank_pair_outcome="scored") == 10
    assert (
        moved(
            before,
            after,
            "rerank_pairs_total",
            rerank_pair_outcome="failed",
            error_type="http_error",
        )
        == 6
    )
    assert moved(before, after, "rerank_request_duration_seconds_count") == 3
    assert moved(before, after, "rerank_scoring_duration_seconds_count") == 3

    port = str(fake_llama.url.rsplit(":", 1)[1])
    instance = {"server_address": "127.0.0.1", "server_port": port, "rerank_backend": "chat"}
    assert (
        moved(
            before,
            after,
            "http_client_request_duration_seconds_count",
            http_response_status_code="200",
            **instance,
        )
        == 10
    )
    assert (
        moved(before, after, "rerank_backend_errors_total", error_type="http_status", **instance)
        == 6
    )
    assert total(after, "http_client_active_requests", **instance) == 0
    assert total(after, "rerank_server_active_rpcs") == 0


async def test_cache_hits_and_misses_are_counted(
    server: RunningServer, client: AsyncRerankClient
) -> None:
    before = await scrape(server)
    await client.rerank("q", ["a", "b", "c"])
    await client.rerank("q", ["a", "b", "c", "d"])
    after = await scrape(server)
    assert moved(before, after, "rerank_cache_lookups_total", rerank_cache_result="miss") == 4
    assert moved(before, after, "rerank_cache_lookups_total", rerank_cache_result="hit") == 3
    assert moved(before, after, "rerank_pairs_total", rerank_pair_outcome="cached") == 3
    assert moved(before, after, "rerank_pairs_total", rerank_pair_outcome="scored") == 4


async def test_threshold_is_recorded(server: RunningServer, client: AsyncRerankClient) -> None:
    before = await scrape(server)
    docs = [{"text": f"d{i}", "retrieval_score": s} for i, s in enumerate([0.9, 0.72, 0.1])]
    await client.rerank("q", docs, top_k=2, threshold=Threshold.adaptive())
    after = await scrape(server)
    assert moved(before, after, "rerank_threshold_final_count") == 1
    assert moved(before, after, "rerank_threshold_final_sum") == pytest.approx(0.70)
    assert moved(before, after, "rerank_threshold_steps_sum") == 1


async def test_reranker_weight_of_request_wide_blends_is_recorded(
    server: RunningServer, client: AsyncRerankClient, fake_llama: FakeLlamaServer
) -> None:
    """How much the reranker counted: 0 for compressed scores, 1 for decisive ones, and
    nothing for a fixed blend. (No shipped profile fits the fake: adaptive answers.)"""
    before = await scrape(server)
    fake_llama.scores = {"w0": 0.50, "w1": 0.51, "w2": 0.52}
    await client.rerank("q1", ["w0", "w1", "w2"])
    fake_llama.scores = {"w0": 0.05, "w1": 0.95, "w2": 0.50}
    await client.rerank("q2", ["w0", "w1", "w2"])
    await client.rerank("q3", ["w0", "w1", "w2"], blend_strategy="linear")
    after = await scrape(server)
    name = "rerank_blend_reranker_weight"
    assert moved(before, after, f"{name}_count", rerank_blend="adaptive") == 2
    assert moved(before, after, f"{name}_sum") == pytest.approx(1.0)
    assert moved(before, after, f"{name}_bucket", le="0.0") == 1
    assert moved(before, after, f"{name}_count", rerank_blend="linear") == 0


async def test_malformed_backend_answers_are_counted_per_instance(
    server: RunningServer, client: AsyncRerankClient, fake_llama: FakeLlamaServer
) -> None:
    fake_llama.mode = "no_logprobs"
    before = await scrape(server)
    await client.rerank("q", ["a", "b", "c"])
    after = await scrape(server)
    assert moved(before, after, "rerank_backend_errors_total", error_type="malformed") == 3
    assert (
        moved(before, after, "rerank_requests_total", rerank_degraded_reason="malformed_response")
        == 1
    )


async def test_metrics_off_serves_nothing(start_server: StartServer) -> None:
    server = await start_server(metrics=False)
    assert server.telemetry.metrics_port is None


async def test_overload_is_shed_counted_and_health_still_answers(
    start_server: StartServer, fake_llama: FakeLlamaServer
) -> None:
    server = await start_server(max_concurrent_rpcs=1)
    fake_llama.latency_s = 0.5
    async with client_of(server) as client:
        before = await scrape(server)
        slow = asyncio.create_task(client.rerank("q", ["a", "b", "c"]))
        assert await asyncio.to_thread(fake_llama.received.wait, 5)
        with pytest.raises(ServerBusyError) as info:
            await client.rerank("q", ["a", "b", "c"])
        assert "max_concurrent_rpcs" in info.value.message
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="rerank.v1.Reranker")
            )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert (await slow).reranked
        after = await scrape(server)
    assert moved(before, after, "rerank_server_rejected_rpcs_total", rpc_method=RERANK) == 1
    assert (
        moved(
            before,
            after,
            "rpc_server_call_duration_seconds_count",
            rpc_method=RERANK,
            rpc_response_status_code="RESOURCE_EXHAUSTED",
        )
        == 1
    )


@pytest.fixture(params=[False, True], ids=["default-spans", "every-span"])
async def traced(
    fake_llama: FakeLlamaServer,
    request: pytest.FixtureRequest,
) -> AsyncIterator[tuple[RunningServer, InMemorySpanExporter]]:
    """A traced server as shipped, and with the opt-in spans (per backend call, per
    CPU-only step)."""
    exporter = InMemorySpanExporter()
    settings = Settings(
        port=0,
        http_port=0,
        backend_url=fake_llama.url,
        probe=False,
        metrics=False,
        trace_backend_calls=request.param,
        trace_steps=request.param,
    )
    server = await build_server(
        settings,
        telemetry=Telemetry.create(
            settings, span_processor=SimpleSpanProcessor(exporter), environ={}
        ),
    )
    yield server, exporter
    await server.stop(grace=0)


TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


def _children(spans: list[ReadableSpan], parent: ReadableSpan) -> list[ReadableSpan]:
    assert parent.context is not None
    return [s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id]


async def test_trace_continues_the_callers_and_has_the_documented_tree(
    traced: tuple[RunningServer, InMemorySpanExporter],
    fake_llama: FakeLlamaServer,
    capsys: pytest.CaptureFixture[str],
) -> None:
    server, exporter = traced
    docs = [f"{CANARY} passage {i}" for i in range(4)]
    async with client_of(server) as client:
        answer = await client.rerank(
            f"{CANARY} query",
            docs,
            instruction=f"{CANARY} instruction",
            request_id="r-1",
            metadata=[("traceparent", f"00-{TRACE_ID}-{PARENT_ID}-01")],
        )
    assert answer.reranked
    spans = list(exporter.get_finished_spans())

    (root,) = [s for s in spans if s.name == f"/{RERANK}"]
    assert root.parent is not None and format(root.parent.span_id, "016x") == PARENT_ID
    assert root.kind is SpanKind.SERVER and root.status.status_code is StatusCode.UNSET
    rpc_attributes = {
        "rpc.system": "grpc",
        "rpc.service": "rerank.v1.Reranker",
        "rpc.method": "Rerank",
        "rpc.grpc.status_code": 0,
    }
    scoring_attributes = {
        "rerank.backend": "chat",
        "rerank.pairs": 4,
        "rerank.model": "fake-reranker.gguf",
        "rerank.scored": 4,
        "rerank.failed": 0,
    }
    assert all(format(s.context.trace_id, "032x") == TRACE_ID for s in spans if s.context)
    steps = {s.name: s for s in _children(spans, root)}
    if server.settings.trace_steps:
        assert set(steps) == {
            "rerank.validate",
            "rerank.shape",
            "rerank.chunk",
            "rerank.score",
            "rerank.blend",
        }
        assert dict(root.attributes or {}) == rpc_attributes
        score = steps["rerank.score"]
        assert dict(score.attributes or {}) == scoring_attributes
    else:
        # One span per request: the server span carries what rerank.score would.
        assert steps == {}
        assert dict(root.attributes or {}) == {**rpc_attributes, **scoring_attributes}
        score = root
    calls = _children(spans, score)
    sent = [tp.split("-")[2] for tp in fake_llama.traceparents]
    assert len(sent) == 4 and all(tp.split("-")[1] == TRACE_ID for tp in fake_llama.traceparents)
    if server.settings.trace_backend_calls:
        assert len(calls) == 4
        for call in calls:
            assert call.name == "POST" and call.attributes is not None
            assert call.attributes["server.address"] == "127.0.0.1"
            assert call.attributes["http.response.status_code"] == 200
            assert call.attributes["rerank.pairs"] == 1
        # The backend received the trace too, each call with its own span as parent.
        assert set(sent) == {format(c.context.span_id, "016x") for c in calls if c.context}
    else:
        # No span per call: every call continues the trace from the scoring's span.
        assert calls == []
        assert score.context is not None
        assert set(sent) == {format(score.context.span_id, "016x")}

    for s in spans:
        for key, value in (s.attributes or {}).items():
            assert CANARY not in str(value), f"{s.name}.{key} carries request text"
        assert CANARY not in s.name

    rpc_lines = [
        json.loads(line)
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("{") and '"event":"rpc"' in line
    ]
    (line,) = [e for e in rpc_lines if e.get("request_id") == "r-1"]
    assert line["trace_id"] == TRACE_ID
    assert root.context is not None and line["span_id"] == format(root.context.span_id, "016x")


async def test_streams_and_batches_trace_each_request_in_a_scoring_span(
    traced: tuple[RunningServer, InMemorySpanExporter],
    fake_llama: FakeLlamaServer,
) -> None:
    """Only a unary Rerank call's server span carries its request's scoring. A RerankBatch
    call carries many requests, and a RerankStream call's pipeline can outlive its server
    span (cancelled while gRPC waits to send): each of their requests' scoring has a
    `rerank.score` span under the call's."""
    server, exporter = traced
    async with client_of(server) as client:
        items = [item async for item in client.stream("q", ["a", "b", "c"])]
        answers = [
            answer
            async for answer in client.rerank_many(
                {"one": ("q1", ["a", "b", "c", "d"]), "two": ("q2", ["c", "d", "e"])}
            )
        ]
    assert len(items) == 4 and len(answers) == 2
    spans = list(exporter.get_finished_spans())
    for name, scored in (("RerankStream", [3]), ("RerankBatch", [3, 4])):
        (call,) = [s for s in spans if s.name == f"/rerank.v1.Reranker/{name}"]
        scores = [s for s in _children(spans, call) if s.name == "rerank.score"]
        assert sorted((s.attributes or {})["rerank.scored"] for s in scores) == scored
        assert "rerank.scored" not in (call.attributes or {})


@pytest.mark.parametrize("steps", [False, True], ids=["default-spans", "step-spans"])
async def test_the_json_api_continues_the_callers_trace(
    fake_llama: FakeLlamaServer, steps: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    """A JSON API request is a SERVER span under the caller's (its `traceparent`
    header), carrying its scoring by default like a Rerank call; a refused one is traced
    with its status, which is the caller's fault and so not an error."""
    exporter = InMemorySpanExporter()
    settings = Settings(
        port=0,
        http_port=free_port(),
        backend_url=fake_llama.url,
        probe=False,
        metrics=False,
        trace_steps=steps,
    )
    server = await build_server(
        settings,
        telemetry=Telemetry.create(
            settings, span_processor=SimpleSpanProcessor(exporter), environ={}
        ),
    )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.http_port}") as http:
            ok = await http.post(
                "/v1/rerank",
                json={"query": f"{CANARY} q", "documents": [f"{CANARY} {i}" for i in range(3)]},
                headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},
            )
            refused = await http.post("/rerank", json={"query": "", "texts": ["a"]})
            await http.get("/health")
        # The response reaches the client as it is sent; the span ends just after.
        assert await eventually(
            lambda: (
                {"POST /v1/rerank", "POST /rerank"}
                <= {s.name for s in exporter.get_finished_spans()}
            ),
            5,
        )
    finally:
        await server.stop(grace=0)
    assert ok.status_code == 200 and refused.status_code == 422
    spans = list(exporter.get_finished_spans())
    (root,) = [s for s in spans if s.name == "POST /v1/rerank"]
    assert root.kind is SpanKind.SERVER and root.status.status_code is StatusCode.UNSET
    assert root.parent is not None and format(root.parent.span_id, "016x") == PARENT_ID
    attributes = dict(root.attributes or {})
    assert attributes["http.response.status_code"] == 200
    assert attributes["http.route"] == "/v1/rerank"
    scoring = [s for s in _children(spans, root) if s.name == "rerank.score"]
    carrier = scoring[0] if steps else root
    assert (carrier.attributes or {})["rerank.scored"] == 3
    assert len(scoring) == (1 if steps else 0)
    assert carrier.context is not None
    assert {tp.split("-")[2] for tp in fake_llama.traceparents} == {
        format(carrier.context.span_id, "016x")
    }
    (tei,) = [s for s in spans if s.name == "POST /rerank"]
    assert (tei.attributes or {})["http.response.status_code"] == 422
    assert tei.status.status_code is StatusCode.UNSET and tei.parent is None
    assert not [s for s in spans if "health" in s.name]
    for s in spans:
        assert CANARY not in str(dict(s.attributes or {}))
    (line,) = [
        json.loads(line)
        for line in capsys.readouterr().out.splitlines()
        if '"rpc":"POST /v1/rerank"' in line
    ]
    assert line["trace_id"] == TRACE_ID
    assert line["span_id"] == format(root.context.span_id, "016x")


async def test_a_refused_call_is_traced_with_its_status(
    traced: tuple[RunningServer, InMemorySpanExporter],
) -> None:
    """A caller's mistake (INVALID_ARGUMENT) is recorded on the server span but is not the
    server's failure; the span still ends."""
    server, exporter = traced
    async with client_of(server) as client:
        with pytest.raises(RerankError):
            await client.rerank("", ["a document"])
    # The status reaches the client as the handler aborts; the span ends just after.
    assert await eventually(
        lambda: any(s.name == f"/{RERANK}" for s in exporter.get_finished_spans()), 5
    )
    (root,) = [s for s in exporter.get_finished_spans() if s.name == f"/{RERANK}"]
    assert root.attributes is not None
    assert root.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert root.status.status_code is StatusCode.UNSET


async def test_health_checks_are_not_traced(
    traced: tuple[RunningServer, InMemorySpanExporter],
) -> None:
    server, exporter = traced
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert exporter.get_finished_spans() == ()


def test_otlp_export_follows_the_standard_variables() -> None:
    """No endpoint: no tracing. OTEL_EXPORTER_OTLP_ENDPOINT turns it on; *_EXPORTER=none off."""
    settings = Settings(metrics=False, http_port=0)
    assert not Telemetry.create(settings, environ={}).tracing
    on = Telemetry.create(settings, environ={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"})
    assert on.tracing
    on.shutdown()
    off = Telemetry.create(
        settings,
        environ={
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1",
            "OTEL_TRACES_EXPORTER": "none",
        },
    )
    assert not off.tracing
    explicit = Telemetry.create(
        dataclasses.replace(settings, otlp_endpoint="http://127.0.0.1:1"), environ={}
    )
    assert explicit.tracing
    explicit.shutdown()


class _Collector(
    metrics_service_pb2_grpc.MetricsServiceServicer,  # type: ignore[misc]
    trace_service_pb2_grpc.TraceServiceServicer,
):  # type: ignore[misc]
    """An OTLP/gRPC collector on loopback that keeps the metric requests it receives."""

    def __init__(self) -> None:
        self.metrics: list[metrics_service_pb2.ExportMetricsServiceRequest] = []

    def Export(self, request: Any, context: grpc.ServicerContext) -> Any:
        if isinstance(request, metrics_service_pb2.ExportMetricsServiceRequest):
            self.metrics.append(request)
            return metrics_service_pb2.ExportMetricsServiceResponse()
        return trace_service_pb2.ExportTraceServiceResponse()


async def test_otlp_metrics_carry_every_backend_call(
    start_server: StartServer, fake_llama: FakeLlamaServer
) -> None:
    """With OTLP metrics on, the per-call histogram goes through the SDK (the Prometheus-only
    path bypasses it), so the collector and /metrics both get every call."""
    collector = _Collector()
    grpc_server = grpc.server(ThreadPoolExecutor(max_workers=2))
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(collector, grpc_server)
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    try:
        server = await start_server(otlp_endpoint=f"http://127.0.0.1:{port}")
        async with client_of(server) as client:
            await client.rerank("q", [f"document {i}" for i in range(5)])
        scraped = await scrape(server)
        await server.stop(grace=0)  # flushes the metrics to the collector
    finally:
        grpc_server.stop(None)
    assert (
        total(
            scraped, "http_client_request_duration_seconds_count", http_response_status_code="200"
        )
        == 5
    )
    points = [
        point
        for request in collector.metrics
        for resource in request.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
        if metric.name == "http.client.request.duration"
        for point in metric.histogram.data_points
    ]
    assert points, "the collector got no http.client.request.duration"
    attributes = {a.key: a.value for a in points[-1].attributes}
    assert attributes["http.response.status_code"].int_value == 200
    assert attributes["rerank.backend"].string_value == "chat"
    assert points[-1].count == 5


async def test_json_requests_in_progress_count_with_grpc_calls(
    start_server: StartServer, fake_llama: FakeLlamaServer
) -> None:
    """`rerank_server_active_rpcs`, what the fleet's autoscaler scales on, counts a JSON
    rerank request while it runs, and lets go of it after."""
    fake_llama.latency_s = 0.5
    server = await start_server(metrics_port=free_port(), http_port=free_port())
    url = f"http://127.0.0.1:{server.http_port}/v1/rerank"
    async with httpx.AsyncClient(timeout=30) as http:
        body = {"query": "q", "documents": ["a", "b", "c"]}
        running = asyncio.ensure_future(http.post(url, json=body))
        route = {"rpc_method": "POST /v1/rerank"}

        async def counted() -> bool:
            return total(await scrape(server), "rerank_server_active_rpcs", **route) == 1

        assert await eventually(counted, 5)
        assert (await running).status_code == 200
    assert total(await scrape(server), "rerank_server_active_rpcs", **route) == 0
