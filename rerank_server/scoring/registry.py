"""Which scorer a deployment gets: one place mapping `--backend` to a class."""

from __future__ import annotations

from ..domain import BackendKind
from ..observability.telemetry import Telemetry
from ..settings import Settings
from .backends.chat import ChatScorer
from .backends.completion import CompletionScorer
from .backends.llm import LlmScorer
from .backends.ollama import OllamaScorer
from .backends.rerank_api import RerankApiScorer
from .base import Scorer
from .single_flight import SingleFlight
from .transport.pool import BackendPool, Ejection


def build_pool(settings: Settings, telemetry: Telemetry | None = None) -> BackendPool:
    telemetry = telemetry or Telemetry.disabled()
    key = settings.outbound_key
    headers = {"Authorization": f"Bearer {key}"} if key else None
    return BackendPool(
        settings.backend_urls,
        concurrency=settings.concurrency,
        timeout_s=settings.backend_timeout_ms / 1000,
        kind=settings.backend,
        metrics=telemetry.metrics,
        tracer=telemetry.tracer,
        headers=headers,
        health_path=settings.health_path,
        trace_calls=settings.trace_backend_calls,
        ejection=Ejection(settings.eject_after, settings.eject_base_s, settings.eject_max_s),
    )


def build_scorer(settings: Settings, pool: BackendPool) -> Scorer:
    """The scorer for `settings.backend`, calling through `pool`, each pair in flight
    sent once however many requests ask for it (`SingleFlight`)."""
    return SingleFlight(_backend_scorer(settings, pool))


def _backend_scorer(settings: Settings, pool: BackendPool) -> Scorer:
    s = settings
    match s.backend:
        case BackendKind.CHAT:
            return ChatScorer(pool, model=s.model, assistant_prefill=s.assistant_prefill)
        case BackendKind.COMPLETION:
            return CompletionScorer(
                pool, model=s.model, assistant_prefill=s.assistant_prefill, max_batch=s.max_batch
            )
        case BackendKind.RERANK:
            return RerankApiScorer(
                pool,
                model=s.model,
                wire_format=s.rerank_format,
                path=s.rerank_path,
                max_batch=s.max_batch,
            )
        case BackendKind.EMBEDDING:
            # Imported here: it brings numpy, memory and start-up time in every server
            # process, which only this backend uses.
            from .backends.embedding import EmbeddingScorer

            return EmbeddingScorer(pool, model=s.model, max_batch=s.max_batch)
        case BackendKind.OLLAMA:
            return OllamaScorer(pool, model=s.model)
        case BackendKind.LLM:
            return LlmScorer(pool, model=s.model, max_batch=s.max_batch)
    raise ValueError(f"unknown backend {s.backend!r}")  # Settings validates it first
