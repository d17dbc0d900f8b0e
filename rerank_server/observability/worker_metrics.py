"""One `/metrics` for several worker processes (`--workers`).

Each worker serves its own Prometheus endpoint on a loopback port only the supervisor
knows. On every scrape the supervisor reads them all and merges them family by family,
each sample labelled with its `worker` (Prometheus rejects a family declared twice, so
the texts cannot simply be joined). Counters and histograms sum across workers with
`sum without (worker) (...)`; a worker that does not answer is left out of that scrape
and shows as `rerank_worker_up{worker="N"} 0`.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Metric, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

WORKER = "worker"
SCRAPE_TIMEOUT_S = 2.0


def merge(texts: Mapping[str, str | None]) -> bytes:
    """Prometheus texts by worker label (None: did not answer) as one exposition."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(texts))
    return generate_latest(registry)


class _Merged(Collector):
    def __init__(self, texts: Mapping[str, str | None]) -> None:
        self._texts = texts

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        for worker, text in self._texts.items():
            for family in text_string_to_metric_families(text or ""):
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit)
                merged.samples.extend(s._replace(labels={**s.labels, WORKER: worker})
                                      for s in family.samples)
        up = Metric("rerank_worker_up", "Whether the worker answered this scrape.", "gauge")
        for worker, text in self._texts.items():
            up.add_sample("rerank_worker_up", {WORKER: worker}, float(text is not None))
        return [*families.values(), up]


def scrape(port: int) -> str | None:
    """One worker's metrics text, or None when it does not answer in time."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                    timeout=SCRAPE_TIMEOUT_S) as response:
            text: str = response.read().decode()
            return text
    except OSError:
        return None


def merged_app(ports: Callable[[], Mapping[str, int]]) -> WSGIApplication:
    """A WSGI app answering with every worker's metrics; `ports` gives the live workers'
    endpoints (worker label -> port) at the time of the scrape."""
    def serve(environ: WSGIEnvironment, start_response: StartResponse) -> list[bytes]:
        live = dict(ports())
        with ThreadPoolExecutor(max_workers=max(len(live), 1)) as pool:
            texts = dict(zip(live, pool.map(scrape, live.values()), strict=True))
        body = merge(texts)
        start_response("200 OK", [("Content-Type", CONTENT_TYPE_LATEST),
                                  ("Content-Length", str(len(body)))])
        return [body]
    return serve
