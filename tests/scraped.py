"""A running server's /metrics, read as Prometheus scrapes it."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from rerank_server.server import RunningServer

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(server: RunningServer) -> Samples:
    """Every sample on /metrics, keyed by (sample name, labels)."""
    async with httpx.AsyncClient() as http:
        response = await http.get(f"http://127.0.0.1:{server.telemetry.metrics_port}/metrics")
    assert response.status_code == 200
    samples: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples named `name` whose labels include `labels`."""
    wanted = set(labels.items())
    return sum(v for (n, lbls), v in samples.items() if n == name and wanted <= lbls)


def moved(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return total(after, name, **labels) - total(before, name, **labels)
