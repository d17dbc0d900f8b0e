"""Managed mode's start: the assets resolved (a model fetched by name too), the scoring
path chosen by the model, and the supervised llama-server started."""

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
from . import assets, gguf_meta, llama_build, memory, scoring_path
from .downloads import STAND_IN_MODEL
from .gguf_meta import GgufError
from .identity import model_identity
from .llama_server import ManagedLlamaServer
from .output_log import prune
from .scoring_path import ScoringPath

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
    name: str = "",
    started_bytes: int = 0,
) -> tuple[Settings, ManagedLlamaServer]:
    """Prepare assets, start llama-server, and return the settings pointed at it;
    `restart_counter` counts its restarts; `name`: the served model's (in log lines);
    `started_bytes`: the memory estimated for the llama-servers started before it."""
    cache = settings.cache_dir
    binary, model = await asyncio.to_thread(
        _resolve_assets, cache, settings.llama_server, settings.model_path, settings.llama_amx
    )
    try:
        header: gguf_meta.Gguf | None = await asyncio.to_thread(gguf_meta.read_header, model)
    except (OSError, GgufError):
        header = None  # `_scoring_path` reads it again to say why
    path = _scoring_path(settings, model, name, header)
    ctx_per_slot = settings.llama_ctx_per_slot
    if path.context_length is not None and path.context_length < ctx_per_slot:
        # An encoder's position table ends at its context length: a longer slot would
        # let a sequence run past it.
        ctx_per_slot = path.context_length
    extra = [*split_args(settings.llama_args), *path.llama_args]
    batch_flags = ("-b", "--batch-size", "-ub", "--ubatch-size")
    if path.context_length is not None and not any(a in batch_flags for a in extra):
        # An encoder reads a sequence in one physical batch: it must hold a whole slot.
        extra += ["-b", str(max(ctx_per_slot, 512)), "-ub", str(max(ctx_per_slot, 512))]
    managed = ManagedLlamaServer(
        binary,
        model,
        slots=settings.llama_slots or settings.concurrency,
        ctx_per_slot=ctx_per_slot,
        extra_args=extra,
        log_path=default_log_path(cache),
        ready_timeout_s=settings.llama_ready_timeout_s,
        restart_counter=restart_counter,
        amx_mode=settings.llama_amx,
        amx_free_build=llama_build.is_amx_free_build(binary, cache),
    )
    managed.memory = _say_memory(managed, name, started_bytes, memory.container_limit(), header)
    # Hashed while llama-server loads (a new file of gigabytes: seconds, once).
    identity = asyncio.create_task(asyncio.to_thread(model_identity, model, cache))
    try:
        await managed.start()
    except BaseException:
        identity.cancel()  # the thread hashes on (the loop's executor ends with it)
        raise
    try:
        managed.identity = await identity
    except BaseException:
        await managed.stop()  # started, and not yet on anyone's exit stack
        raise
    changes: dict[str, object] = {"backend_url": managed.url, "backend": path.backend}
    if model.name == STAND_IN_MODEL.name and settings.assistant_prefill:
        # The stand-in chat model does not know Qwen3-Reranker's think block: with it, no
        # yes/no token reaches its top logprobs and every pair would fail.
        changes["assistant_prefill"] = False
        log.info("assistant_prefill_off", reason="stand-in model")
    return dataclasses.replace(settings, **changes), managed  # type: ignore[arg-type]


def _scoring_path(
    settings: Settings, model: Path, name: str = "", header: gguf_meta.Gguf | None = None
) -> ScoringPath:
    """The backend managed mode scores `model` by (its `header`, read when not given),
    and what llama-server needs for it; said in one `managed_backend` line. The
    operator's `--managed-backend` (or `--backend`) wins; else the file's metadata
    decides; else `--backend`."""
    chosen = settings.managed_backend
    try:
        found = scoring_path.choose(header) if header else scoring_path.read_path(model)
    except (OSError, GgufError) as exc:
        found, unread = None, f"its metadata could not be read ({exc})"
    else:
        unread = "not a reranker, cross-encoder or embedding GGUF"
    if chosen is not ManagedBackend.AUTO:
        backend = BackendKind(chosen.value)
        path = ScoringPath(
            backend,
            "the operator's --managed-backend / --backend",
            _args_for(backend, found),
            found.context_length if found else None,
        )
    elif found is not None:
        path = found
    else:
        path = ScoringPath(settings.backend, f"{unread}: --backend")
    log.info(
        "managed_backend",
        backend=path.backend.value,
        model=model.name,
        served_as=name or None,
        reason=path.why,
    )
    return path


def _say_memory(
    managed: ManagedLlamaServer,
    name: str,
    started_bytes: int,
    limit: int | None,
    header: gguf_meta.Gguf | None,
) -> memory.MemoryEstimate:
    """What this llama-server will hold (its file alone when the header was not read),
    said before it starts in one `llama_server_memory` line, and a warning when with
    those started before it passes the container's limit: an OOM kill in a minute would
    otherwise be the first word of it. Layers put on a GPU are in the device's memory."""
    tokens = managed.slots * managed.ctx_per_slot
    # Its whole command line: the `-c` managed mode passes, then the operator's, and an
    # argument beats llama-server's variable for it.
    args = managed.command()
    if header is None:
        estimate = memory.MemoryEstimate(managed.model.stat().st_size, None, tokens)
    else:
        estimate = memory.estimate(header, tokens, args)
    gpu = memory.offloaded(args)
    log.info(
        "llama_server_memory",
        model=managed.model.name,
        served_as=name or None,
        file_bytes=estimate.file_bytes,
        kv_cache_bytes=estimate.kv_cache_bytes,
        kv_cache_tokens=estimate.kv_cache_tokens,
        estimate_bytes=estimate.total_bytes,
        container_limit_bytes=limit,
        gpu_layers=memory.setting(args, memory.GPU_LAYERS) if gpu else None,
    )
    total = started_bytes + estimate.at_least_bytes
    if limit is not None and total > limit and not gpu:
        log.warning(
            "managed_memory_over_limit",
            model=managed.model.name,
            served_as=name or None,
            total_estimate_bytes=total,
            container_limit_bytes=limit,
            advice="fewer slots (--llama-slots), a shorter --llama-ctx-per-slot, "
            "a smaller quantization, or a higher memory limit",
        )
    return estimate


def _args_for(backend: BackendKind, found: ScoringPath | None) -> tuple[str, ...]:
    """llama-server's arguments for a path the operator chose."""
    if found is not None and found.backend is backend:
        return found.llama_args
    if backend is BackendKind.RERANK:
        return ("--rerank",)
    if backend is BackendKind.EMBEDDING:
        return ("--embedding",)
    return ()


def _resolve_assets(
    cache: Path, llama_server: str, model_path: str, amx_mode: LlamaAmx
) -> tuple[Path, Path]:
    with assets.cache_lock(cache):
        binary = llama_build.resolve_llama_server(
            Path(llama_server) if llama_server else None, cache, build=True, amx_mode=amx_mode
        )
        model = assets.resolve_model(model_path or None, cache, fetch_missing=True)
    return binary, model
