"""Managed mode's start: the assets resolved, the scoring path chosen by the model, and
the supervised llama-server started (`ManagedLlamaServer`)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shlex
from pathlib import Path

import structlog

from ..domain import BackendKind
from ..observability.instruments import Adder
from ..settings import LlamaAmx, ManagedBackend, Settings
from . import assets, gguf_meta, llama_build
from .llama_server import ManagedLlamaServer
from .output_log import prune

log = structlog.get_logger(__name__)


def split_args(raw: str) -> list[str]:
    return shlex.split(raw) if raw.strip() else []


def default_log_path(cache_dir: Path) -> Path:
    """Named after this process, not llama-server's: its restarts append to one file.
    Logs of earlier runs beyond the newest `output_log.KEEP_FILES` are removed."""
    path = cache_dir / "logs" / f"llama-server-{os.getpid()}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    prune(path.parent, "llama-server-*.log")
    return path


async def start_managed(
    settings: Settings,
    restart_counter: Adder | None = None,
) -> tuple[Settings, ManagedLlamaServer]:
    """Prepare assets, start llama-server, and return the settings pointed at it;
    `restart_counter` counts its restarts."""
    cache = settings.cache_dir
    binary, model = await asyncio.to_thread(
        _resolve_assets, cache, settings.llama_server, settings.model_path, settings.llama_amx
    )
    backend, scoring_args = _scoring_path(settings, model)
    managed = ManagedLlamaServer(
        binary,
        model,
        slots=settings.llama_slots or settings.concurrency,
        ctx_per_slot=settings.llama_ctx_per_slot,
        extra_args=[*split_args(settings.llama_args), *scoring_args],
        log_path=default_log_path(cache),
        ready_timeout_s=settings.llama_ready_timeout_s,
        restart_counter=restart_counter,
        amx_mode=settings.llama_amx,
        amx_free_build=llama_build.is_amx_free_build(binary, cache),
    )
    await managed.start()
    changes: dict[str, object] = {"backend_url": managed.url, "backend": backend}
    if not settings.model_path and settings.assistant_prefill:
        # The stand-in chat model does not know Qwen3-Reranker's think block: with it, no
        # yes/no token reaches its top logprobs and every pair would fail.
        changes["assistant_prefill"] = False
        log.info("assistant_prefill_off", reason="stand-in model")
    return dataclasses.replace(settings, **changes), managed  # type: ignore[arg-type]


RERANKER_PATH_WHY = (
    "completion: prompt arrays, each slot reusing the prompt prefix the "
    "request's passages share, scored 40 passages 2.2x faster than "
    "llama-server --rerank on the CPU"
)


def _scoring_path(settings: Settings, model: Path) -> tuple[BackendKind, list[str]]:
    """The backend managed mode scores by, and what llama-server needs for it; said in one
    `managed_backend` line."""
    chosen = settings.managed_backend
    if chosen is not ManagedBackend.AUTO:
        backend, why = BackendKind(chosen.value), "--managed-backend"
    elif not settings.model_path:
        backend, why = settings.backend, "the stand-in model"
    else:
        try:
            kind = gguf_meta.reranker_kind(gguf_meta.read(model))
        except (OSError, gguf_meta.GgufError) as exc:
            kind, unread = None, f"its metadata could not be read ({exc})"
        else:
            unread = "not a reranker GGUF"
        if kind is None:
            backend, why = settings.backend, f"{unread}: --backend"
        else:
            backend, why = BackendKind.COMPLETION, f"{kind.why}; {RERANKER_PATH_WHY}"
    args = ["--rerank"] if backend is BackendKind.RERANK else []
    log.info("managed_backend", backend=backend.value, model=model.name, reason=why)
    return backend, args


def _resolve_assets(
    cache: Path, llama_server: str, model_path: str, amx_mode: LlamaAmx
) -> tuple[Path, Path]:
    with assets.cache_lock(cache):
        binary = llama_build.resolve_llama_server(
            Path(llama_server) if llama_server else None, cache, build=True, amx_mode=amx_mode
        )
        model = assets.resolve_model(
            Path(model_path) if model_path else None, cache, fetch_missing=True
        )
    return binary, model
