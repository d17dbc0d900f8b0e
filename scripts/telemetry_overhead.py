"""Measure what metrics and tracing add per request, side by side in one process.

Usage: python scripts/telemetry_overhead.py [--requests 300] [--candidates 20]
                                            [--out bench-results/telemetry.json]

Three servers run against the same instant fake llama-server (tests/fakes/llama.py):
`off` (no metrics, no tracing), `metrics` (the Prometheus reader, as shipped), and
`metrics+traces` (also every span, handed to a batch processor whose exporter drops
them, so the cost is ours and not a collector's). Requests go round-robin over the three
so machine noise hits each alike; the report gives p50/p99 latency and process CPU time
per request, and the ratios to `off`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from rerank_client import AsyncRerankClient

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from rerank_server.observability.telemetry import Telemetry
from rerank_server.server import RunningServer, build_server
from rerank_server.settings import Settings
from tests.fakes.llama import FakeLlamaServer


class _Drop(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


async def _start(name: str, backend_url: str) -> RunningServer:
    settings = Settings(port=0, backend_url=backend_url, probe=False, metrics=name != "off",
                        metrics_port=0, log_level="warning")
    # As in production: a batch processor, not the synchronous one tests use.
    processor = BatchSpanProcessor(_Drop()) if name == "metrics+traces" else None
    telemetry = Telemetry.create(settings, span_processor=processor, environ={})
    return await build_server(settings, telemetry=telemetry)


async def run(requests: int, candidates: int) -> dict[str, dict[str, float]]:
    from rerank_server.observability import logs
    from rerank_server.settings import LogFormat

    logs.configure("warning", LogFormat.JSON)
    fake = FakeLlamaServer().start()
    names = ("off", "metrics", "metrics+traces")
    servers = {n: await _start(n, fake.url) for n in names}
    clients = {n: AsyncRerankClient(f"127.0.0.1:{s.port}") for n, s in servers.items()}
    docs = [f"passage number {i} about something" for i in range(candidates)]
    latencies: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, float] = dict.fromkeys(names, 0.0)
    for n in names:  # warm up channels and code paths
        for _ in range(20):
            await clients[n].rerank("warm up query", docs)
    for _ in range(requests):
        for n in names:
            c0, t0 = time.process_time(), time.perf_counter()
            await clients[n].rerank("what is measured here", docs)
            latencies[n].append(time.perf_counter() - t0)
            cpu[n] += time.process_time() - c0
    for n in names:
        await clients[n].close()
        await servers[n].stop(grace=0)
    fake.stop()

    report: dict[str, dict[str, float]] = {}
    for n in names:
        lat = sorted(latencies[n])
        report[n] = {
            "p50_ms": statistics.median(lat) * 1000,
            "p99_ms": lat[int(len(lat) * 0.99) - 1] * 1000,
            "cpu_ms_per_request": cpu[n] / requests * 1000,
        }
    for n in names:
        report[n]["p50_ratio"] = report[n]["p50_ms"] / report["off"]["p50_ms"]
        report[n]["cpu_ratio"] = (report[n]["cpu_ms_per_request"]
                                  / report["off"]["cpu_ms_per_request"])
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--candidates", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("bench-results/telemetry.json"))
    args = parser.parse_args()
    report = asyncio.run(run(args.requests, args.candidates))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"requests": args.requests, "candidates": args.candidates,
                                    "results": report}, indent=2) + "\n")
    print(f"{args.requests} requests x {args.candidates} candidates, instant fake backend")
    print("| setup | p50 ms | p99 ms | CPU ms/request | p50 vs off | CPU vs off |")
    print("|---|---|---|---|---|---|")
    for name, r in report.items():
        print(f"| {name} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
              f"{r['cpu_ms_per_request']:.2f} | {r['p50_ratio']:.2f} | {r['cpu_ratio']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
