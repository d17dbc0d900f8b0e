"""The `telemetry` scenario: what metrics and tracing add per request, side by side.

Five servers in this process, one per setup (`SETUPS`), round-robin (docs/benchmarks.md).
"""

from __future__ import annotations

import io
import statistics
import time
from collections.abc import Sequence
from typing import Any

import structlog
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from rerank_client import AsyncRerankClient

from ..domain import BackendKind
from ..observability import logs
from ..observability.telemetry import Telemetry
from ..server import RunningServer, build_server, freeze_startup_objects
from ..settings import LogFormat, Settings

# Off; the Prometheus reader, as shipped; with the default spans (exported to a batch
# processor whose exporter drops them: the cost is ours, not a collector's); with
# `--trace-steps`; with `--trace-backend-calls`.
SETUPS = ("off", "metrics", "metrics+traces", "metrics+traces+steps", "metrics+traces+calls")


class _Discard(io.TextIOBase):
    def write(self, text: str) -> int:
        return len(text)


class _Drop(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


# A per-pair backend and a batching one: the same telemetry per request is a larger share
# of a batched request, which costs a tenth as much CPU.
KINDS = ("chat", "rerank")


async def _start(setup: str, backend_url: str, kind: str) -> RunningServer:
    settings = Settings(
        port=0,
        backend=BackendKind(kind),
        backend_url=backend_url,
        max_batch=100,
        max_candidates=100,
        probe=False,
        metrics=setup != "off",
        http_port=0,
        metrics_port=0,
        cache_entries=0,
        log_level="warning",
        trace_backend_calls=setup.endswith("+calls"),
        trace_steps=setup.endswith("+steps"),
    )
    # As in production: a batch processor, not the synchronous one tests use.
    processor = BatchSpanProcessor(_Drop()) if "traces" in setup else None
    telemetry = Telemetry.create(settings, span_processor=processor, environ={})
    return await build_server(settings, telemetry=telemetry)


async def telemetry_cost(
    backend_url: str, requests: int, docs: Sequence[str], kind: str = "chat"
) -> dict[str, Any]:
    # Logs as a server writes them by default (a JSON line per RPC at info), discarded:
    # part of every setup's cost, and not the benchmark's output. The logging set up
    # before is put back afterwards (setting it to "warning" left later log lines of
    # the same process unwritten: in the test suite, those of the tests after it).
    before = structlog.get_config()
    logs.configure("info", LogFormat.JSON, stream=_Discard())
    servers = {s: await _start(s, backend_url, kind) for s in SETUPS}
    freeze_startup_objects()  # as `server.serve` does
    clients = {s: AsyncRerankClient(f"127.0.0.1:{server.port}") for s, server in servers.items()}
    latencies: dict[str, list[float]] = {s: [] for s in SETUPS}
    cpu = dict.fromkeys(SETUPS, 0.0)
    try:
        for s in SETUPS:  # warm up channels and code paths
            for i in range(10):
                await clients[s].rerank(f"warm up {i}", docs)
        for i in range(requests):
            for s in SETUPS:
                c0, t0 = time.process_time(), time.perf_counter()
                await clients[s].rerank(f"what is measured here {i}", docs)
                latencies[s].append(time.perf_counter() - t0)
                cpu[s] += time.process_time() - c0
    finally:
        for s in SETUPS:
            await clients[s].close()
            await servers[s].stop(grace=0)
        structlog.configure(**before)
    report: dict[str, Any] = {"backend": kind, "candidates": len(docs), "requests": requests}
    for s in SETUPS:
        report[s] = {
            "p50_ms": round(statistics.median(latencies[s]) * 1000, 2),
            "cpu_ms_per_request": round(cpu[s] / requests * 1000, 2),
        }
    for s in SETUPS:
        report[s]["p50_ratio"] = round(report[s]["p50_ms"] / report["off"]["p50_ms"], 3)
        report[s]["cpu_ratio"] = round(
            report[s]["cpu_ms_per_request"] / report["off"]["cpu_ms_per_request"], 3
        )
    return report


def telemetry_markdown(r: dict[str, Any]) -> list[str]:
    lines = [
        f"#### Telemetry, `{r['backend']}` (instant fake backend, servers and client "
        "in one process)",
        "",
        f"{r['requests']} requests x {r['candidates']} candidates per setup.",
        "",
        "| setup | p50 ms | CPU ms/request | p50 vs off | CPU vs off |",
        "|---|---|---|---|---|",
    ]
    for s in SETUPS:
        x = r[s]
        lines.append(
            f"| {s} | {x['p50_ms']} | {x['cpu_ms_per_request']} | "
            f"{x['p50_ratio']} | {x['cpu_ratio']} |"
        )
    return [*lines, ""]
