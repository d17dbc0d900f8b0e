"""One `/metrics` for several worker processes (`--workers`), merged by the supervisor.

What it serves: docs/observability.md, "Metrics".
"""

from __future__ import annotations

import urllib.request
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

from opentelemetry.metrics import NoOpMeterProvider
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Metric, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from .instruments import SCOPE_NAME, Adder, Instruments
from .metrics import LLAMA_RESTARTS

WORKER = "worker"
SCRAPE_TIMEOUT_S = 2.0


class SupervisorMetrics:
    """The supervisor's own series: `rerank.llama_server.restarts` (managed mode) and
    `rerank.worker.restarts`. Served on the merged Prometheus endpoint only: with OTLP
    metrics on, the workers push their own series and these two do not leave."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        make = Instruments(NoOpMeterProvider().get_meter(SCOPE_NAME), self.registry)
        self.llama_restarts: Adder = make.counter(*LLAMA_RESTARTS)
        self.worker_restarts: Adder = make.counter(
            "rerank.worker.restarts",
            "{restart}",
            "Worker processes (--workers) started again after one exited.",
        )
        # Shown at 0 from the start, so that `increase()` sees the first restart (the
        # llama-server's is, by the managed llama-server, where there is one).
        self.worker_restarts.add(0)

    def text(self) -> str:
        return generate_latest(self.registry).decode()


def merge(texts: Mapping[str, str | None], own: str = "") -> bytes:
    """Prometheus texts by worker label (None: did not answer) as one exposition, with
    the samples of `own` (the supervisor's) unlabelled. Merged family by family:
    Prometheus rejects a family declared twice, so the texts cannot simply be joined."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(texts, own))
    return generate_latest(registry)


class _Merged(Collector):
    def __init__(self, texts: Mapping[str, str | None], own: str) -> None:
        self._texts = texts
        self._own = own

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        sources = [(None, self._own), *self._texts.items()]
        for worker, text in sources:
            for family in text_string_to_metric_families(text or ""):
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit
                    )
                merged.samples.extend(
                    family.samples
                    if worker is None
                    else (s._replace(labels={**s.labels, WORKER: worker}) for s in family.samples)
                )
        up = Metric("rerank_worker_up", "Whether the worker answered this scrape.", "gauge")
        for worker, text in self._texts.items():
            up.add_sample("rerank_worker_up", {WORKER: worker}, float(text is not None))
        return [*families.values(), up]


def scrape(port: int) -> str | None:
    """One worker's metrics text, or None when it does not answer in time."""
    try:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{port}/metrics", timeout=SCRAPE_TIMEOUT_S
        ) as response:
            text: str = response.read().decode()
            return text
    except OSError:
        return None


def merged_app(
    ports: Callable[[], Mapping[str, int]], own: SupervisorMetrics | None = None
) -> WSGIApplication:
    """A WSGI app answering with every worker's metrics and `own`'s; `ports` gives the
    live workers' endpoints (worker label -> port) at the time of the scrape."""

    def serve(environ: WSGIEnvironment, start_response: StartResponse) -> list[bytes]:
        live = dict(ports())
        with ThreadPoolExecutor(max_workers=max(len(live), 1)) as pool:
            texts = dict(zip(live, pool.map(scrape, live.values()), strict=True))
        body = merge(texts, own.text() if own is not None else "")
        start_response(
            "200 OK", [("Content-Type", CONTENT_TYPE_LATEST), ("Content-Length", str(len(body)))]
        )
        return [body]

    return serve
