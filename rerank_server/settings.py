"""Server settings: each one defined once, giving a command-line flag and a `RERANK_*` variable.

Precedence: flag, then variable, then default; bad values named in both spellings.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shlex
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from pathlib import Path
from typing import Any

from .domain import BackendKind, BlendStrategy
from .errors import ConfigError

ENV_PREFIX = "RERANK_"
# Ends each `--model NAME=SOURCE` in `Settings.models` (`model_specs.parse_entries`).
FLAG_ENTRY_END = "\0"
DEFAULT_INSTRUCTION = "Given a query, retrieve relevant passages that answer the query"


class RerankFormat(StrEnum):
    """Wire format of the `rerank` backend."""

    COHERE = "cohere"  # {query, documents} -> results[].relevance_score
    TEI = "tei"  # {query, texts} -> [{index, score}]


class LlamaAmx(StrEnum):
    """Whether llama-server may use llama.cpp's AMX kernels (managed/amx.py)."""

    AUTO = "auto"  # built without them; LLAMA_ARG_REPACK=0 for other binaries on AMX CPUs
    ON = "on"  # built with them where the CPU has AMX; nothing passed
    OFF = "off"  # built without them; LLAMA_ARG_REPACK=0 always


class ManagedBackend(StrEnum):
    """How managed mode scores with its llama-server (managed/llama_server.py)."""

    AUTO = "auto"  # by the model's GGUF metadata: a reranker's fastest path, else --backend
    CHAT = "chat"
    COMPLETION = "completion"
    RERANK = "rerank"  # llama-server --rerank: a GGUF with a rank head
    EMBEDDING = "embedding"  # llama-server --embedding: an embedding model, by cosine


class LogFormat(StrEnum):
    """How log lines are written: JSON lines, console output, or by whether stdout is a tty."""

    AUTO = "auto"
    JSON = "json"
    CONSOLE = "console"


def _opt(
    help: str, *, minimum: float | None = None, maximum: float | None = None, group: str = "server"
) -> dict[str, Any]:
    return {"help": help, "minimum": minimum, "maximum": maximum, "group": group}


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rerank-server"


@dataclass(frozen=True, slots=True)
class Settings:
    """Every setting: a field `max_candidates` is `--max-candidates` and
    `RERANK_MAX_CANDIDATES`, its metadata the help and bounds (`_opt`)."""

    # --- listening
    host: str = field(
        default="127.0.0.1",
        metadata=_opt("Address to listen on. Loopback by default; 0.0.0.0 exposes the server."),
    )
    port: int = field(
        default=50051, metadata=_opt("gRPC port (0 picks a free one).", minimum=0, maximum=65535)
    )
    reflection: bool = field(default=True, metadata=_opt("Serve gRPC server reflection."))
    http_port: int = field(
        default=50052,
        metadata=_opt(
            "Port of the JSON rerank API (Cohere/Jina /v1/rerank and /v2/rerank, TEI /rerank; "
            "docs/http.md) on --host; 0 turns it off.",
            minimum=0,
            maximum=65535,
        ),
    )
    max_connections: int = field(
        default=1024,
        metadata=_opt(
            "Connections open at once on each port, gRPC and HTTP (per worker); more are "
            "closed at once (HTTP: after a 503). Idle ones close after 5 min on gRPC and 5 s "
            "on HTTP; one that has not sent its preface (gRPC) or a whole request head (HTTP) "
            "within 10 s is closed (docs/security.md).",
            minimum=1,
            maximum=2**31 - 1,
        ),
    )  # gRPC takes a 32-bit int: more is an OverflowError
    tls_cert: str = field(
        default="",
        metadata=_opt(
            "PEM certificate chain for TLS on the gRPC and HTTP ports (with --tls-key); "
            "re-read when the file changes.",
            group="security",
        ),
    )
    tls_key: str = field(
        default="", metadata=_opt("PEM private key for --tls-cert.", group="security")
    )
    tls_client_ca: str = field(
        default="",
        metadata=_opt(
            "PEM CA bundle: when set, callers must present a client certificate it signed "
            "(mutual TLS).",
            group="security",
        ),
    )
    auth_tokens: str = field(
        default="",
        metadata=_opt(
            "Bearer tokens callers must present (comma-separated, 16+ characters each); empty: "
            "no authentication. Health checks stay open.",
            group="security",
        ),
    )
    auth_tokens_file: str = field(
        default="",
        metadata=_opt(
            "File of bearer tokens, one per line, each optionally followed by its name and "
            "limits (name=, rps=, pairs_per_minute=, concurrent=, priority=; "
            'docs/security.md, "Per-token limits"); mount a Kubernetes Secret here.',
            group="security",
        ),
    )
    grace_period_s: float = field(
        default=10.0,
        metadata=_opt(
            "On SIGTERM/SIGINT, how long in-flight calls may run before they are cancelled.",
            minimum=0,
        ),
    )
    max_concurrent_rpcs: int = field(
        default=256,
        metadata=_opt(
            "Reranker RPCs handled at once; more are refused with RESOURCE_EXHAUSTED (health "
            "checks are never refused).",
            minimum=1,
        ),
    )
    max_message_bytes: int = field(
        default=4 * 1024 * 1024,
        metadata=_opt(
            "Largest request or response message in bytes (gRPC's own default; a larger gRPC "
            "message is refused from its length, before it is read). It sizes the memory a "
            'burst of large requests takes (docs/reliability.md, "Memory").',
            minimum=1024,
            maximum=2**31 - 1,
        ),
    )  # gRPC takes a 32-bit int: more is an OverflowError
    max_inflight_bytes: int = field(
        default=64 * 1024 * 1024,
        metadata=_opt(
            "Request bytes being worked on at once, over all calls (a worker's: each has its "
            "own); a request that would pass it is refused with RESOURCE_EXHAUSTED (memory "
            "stays bounded: docs/reliability.md).",
            minimum=1024,
        ),
    )
    workers: int = field(
        default=1,
        metadata=_opt(
            "Server processes sharing --port and --http-port (SO_REUSEPORT); --concurrency is "
            "split between them, so the backend never sees more. 0: one per CPU core, at most "
            '--concurrency (docs/deploy.md, "Workers or replicas").',
            minimum=0,
            maximum=256,
        ),
    )
    worker_start_timeout_s: float = field(
        default=60.0,
        metadata=_opt(
            "How long a worker (--workers) may take to listen. At startup one that has not is "
            "a failed start; a replacement that has not is killed and tried again, with the "
            'restart back-off (docs/reliability.md, "What dies, or hangs, is restarted").',
            minimum=1,
        ),
    )
    batch_concurrency: int = field(
        default=8, metadata=_opt("Requests of one RerankBatch stream processed at once.", minimum=1)
    )

    # --- backend
    backend: BackendKind = field(
        default=BackendKind.CHAT,
        metadata=_opt(
            "Scoring backend kind: chat, completion, rerank, embedding, ollama, llm "
            "(docs/backends.md).",
            group="backend",
        ),
    )
    backend_url: str = field(
        default="http://127.0.0.1:8080",
        metadata=_opt(
            "Base URL of the model server; several instances comma-separated.", group="backend"
        ),
    )
    backend_api_key: str = field(
        default="",
        metadata=_opt(
            "Sent as `Authorization: Bearer ...` to the backend (hosted rerank and LLM APIs). "
            "Not for callers of this server: see --auth-tokens.",
            group="backend",
        ),
    )
    api_key: str = field(
        default="",
        metadata=_opt(
            "Deprecated name of --backend-api-key (the key sent TO the backend; in TEI, vLLM "
            "and llama-server the same flag means the opposite). Still works, with a warning.",
            group="backend",
        ),
    )
    max_batch: int = field(
        default=32,
        metadata=_opt(
            "Most documents in one backend call for the batching backends (completion, "
            "rerank, embedding, llm); larger requests are split.",
            minimum=1,
            group="backend",
        ),
    )
    rerank_format: RerankFormat = field(
        default=RerankFormat.COHERE,
        metadata=_opt(
            "rerank backend wire format: cohere ({query, documents} -> results[].relevance_"
            "score; llama-server, vLLM, Infinity, Jina, Cohere) or tei ({query, texts} -> "
            "[{index, score}]).",
            group="backend",
        ),
    )
    rerank_path: str = field(
        default="/v1/rerank",
        metadata=_opt("Path of the rerank endpoint (TEI: /rerank).", group="backend"),
    )
    health_path: str = field(
        default="/health",
        metadata=_opt(
            "Path polled on each backend instance (200 = up). Ollama: /api/version. Empty: "
            "no polling (hosted APIs); instances count as up, ejected ones return after "
            "their back-off.",
            group="backend",
        ),
    )
    eject_after: int = field(
        default=3,
        metadata=_opt(
            "Consecutive failed calls (refused, 5xx, timed out, or abandoned without an answer) "
            "that take a backend instance out of the pool.",
            minimum=1,
            group="backend",
        ),
    )
    eject_base_s: float = field(
        default=1.0,
        metadata=_opt(
            "First back-off of an ejected instance, after which one probe call decides whether "
            "it returns; doubles for each failed probe.",
            minimum=0.01,
            group="backend",
        ),
    )
    eject_max_s: float = field(
        default=4.0,
        metadata=_opt(
            "Longest back-off of an ejected instance: a recovered backend is back within about "
            "this long.",
            minimum=0.01,
            group="backend",
        ),
    )
    model: str = field(
        default="",
        metadata=_opt(
            "NAME=SOURCE: serve a model by NAME (repeatable; SOURCE a GGUF file, "
            "hf:ORG/REPO[/FILE.gguf], or backend URLs; docs/models.md). A plain NAME: the "
            "model name sent to the backend and reported in responses (empty: as the "
            "backend reports it).",
            group="backend",
        ),
    )
    concurrency: int = field(
        default=4,
        metadata=_opt(
            "Scoring requests in flight to the backend at once; keep at or below its slot "
            "count (llama-server -np).",
            minimum=1,
            group="backend",
        ),
    )
    backend_timeout_ms: int = field(
        default=30_000,
        metadata=_opt("Timeout of one HTTP call to the backend.", minimum=1, group="backend"),
    )
    assistant_prefill: bool = field(
        default=True,
        metadata=_opt(
            "Send Qwen3-Reranker's empty think block as an assistant prefill.", group="backend"
        ),
    )

    # --- ranking defaults (a request may override the ones marked so in the proto)
    blend_strategy: BlendStrategy = field(
        default=BlendStrategy.PROFILE,
        metadata=_opt("Default blend of reranker score and retrieval rank.", group="ranking"),
    )
    http_blend_strategy: BlendStrategy = field(
        default=BlendStrategy.RERANK_ONLY,
        metadata=_opt(
            "Blend of the JSON rerank API when a request names none: rerank_only answers in "
            "the model's order with its scores as relevance_score, as Cohere, Jina and TEI "
            "do; any other strategy makes relevance_score the blended score (docs/http.md).",
            group="ranking",
        ),
    )
    blend_profile: str = field(
        default="",
        metadata=_opt(
            "JSON file of fitted blend profiles for the `profile` strategy (docs/blending.md); "
            "empty: the profiles shipped with the server.",
            group="ranking",
        ),
    )
    instruction: str = field(
        default=DEFAULT_INSTRUCTION,
        metadata=_opt("Default task instruction given to the scorer.", group="ranking"),
    )
    timeout_ms: int = field(
        default=10_000,
        metadata=_opt(
            "Default time budget per request; the gRPC deadline shortens it.",
            minimum=1,
            group="ranking",
        ),
    )
    max_candidates: int = field(
        default=100,
        metadata=_opt(
            "Candidates scored per request (best retrieval ranks first); the rest follow in "
            "retrieval order, unscored, and the answer says so (degraded CAPPED). The default "
            "scores all that --max-request-candidates admits; --timeout-ms bounds the time.",
            minimum=1,
            group="ranking",
        ),
    )
    min_candidates: int = field(
        default=1,
        metadata=_opt(
            "With fewer candidates, answer in retrieval order without scoring.",
            minimum=0,
            group="ranking",
        ),
    )
    max_chunk_chars: int = field(
        default=2000,
        metadata=_opt(
            "Documents longer than this are cut to their best-matching window.",
            minimum=100,
            group="ranking",
        ),
    )
    max_tokens_per_doc: int = field(
        default=0,
        metadata=_opt(
            "Most tokens of each document the model reads (a request may set its own); 0: "
            "only the model's context per slot limits it (documents are always cut to fit).",
            minimum=0,
            group="ranking",
        ),
    )
    disabled: bool = field(
        default=False,
        metadata=_opt("Answer every request in retrieval order without scoring.", group="ranking"),
    )

    # --- shaping: fusion, skip rules (docs/api.md)
    fusion_k: int = field(
        default=60,
        metadata=_opt(
            "Reciprocal rank fusion constant k in weight / (k + rank).", minimum=1, group="shaping"
        ),
    )
    original_list_weight: float = field(
        default=2.0,
        metadata=_opt(
            "Fusion weight of a list from the original query, unless the list sets one.",
            minimum=0,
            group="shaping",
        ),
    )
    expansion_list_weight: float = field(
        default=1.0,
        metadata=_opt(
            "Fusion weight of a list from an expanded query, unless the list sets one.",
            minimum=0,
            group="shaping",
        ),
    )
    max_lists: int = field(
        default=8,
        metadata=_opt(
            "Most ranked lists one request may carry (each up to --max-request-candidates).",
            minimum=1,
            group="shaping",
        ),
    )
    skip_within_top_k: bool = field(
        default=False,
        metadata=_opt(
            "Skip scoring when a request has no more candidates than its top_k.", group="shaping"
        ),
    )
    strong_signal_skip: bool = field(
        default=False,
        metadata=_opt(
            "Skip scoring when a lexical list has a clear winner (see the next two).",
            group="shaping",
        ),
    )
    strong_signal_min: float = field(
        default=0.85,
        metadata=_opt(
            "Strong signal: the lexical list's top normalized score is at least this...",
            minimum=0,
            maximum=1,
            group="shaping",
        ),
    )
    strong_signal_gap: float = field(
        default=0.15,
        metadata=_opt(
            "...and leads the second by at least this.", minimum=0, maximum=1, group="shaping"
        ),
    )

    # --- score cache (docs/api.md, "Score cache")
    cache_entries: int = field(
        default=50_000,
        metadata=_opt(
            "Reranker scores kept in memory (least recently used go first); 0 keeps none "
            "there: the cache is off, unless --cache-path keeps it on disk.",
            minimum=0,
            group="cache",
        ),
    )
    cache_ttl_s: float = field(
        default=3600.0, metadata=_opt("How long a cached score is used.", minimum=0, group="cache")
    )
    cache_path: str = field(
        default="",
        metadata=_opt(
            "SQLite file that keeps scores across restarts (empty: memory only).", group="cache"
        ),
    )
    cache_url: str = field(
        default="",
        metadata=_opt(
            "Redis or Valkey shared by replicas for scores, behind the memory tier: "
            "redis://[USER:PASSWORD@]HOST:6379/0, rediss:// for TLS (empty: none; "
            'docs/deploy.md, "Scaling out"). Per-token limits are counted there too.',
            group="cache",
        ),
    )
    cache_timeout_ms: float = field(
        default=5.0,
        metadata=_opt(
            "Longest a request waits for the shared cache (--cache-url); past it, its "
            "lookups count as misses and scoring goes on.",
            minimum=0.1,
            group="cache",
        ),
    )
    cache_key_prefix: str = field(
        default="rerank:",
        metadata=_opt("Prefix of every key rerank-server writes to --cache-url.", group="cache"),
    )
    cache_tls_ca: str = field(
        default="",
        metadata=_opt(
            "PEM CA bundle that signed the shared cache's certificate (rediss://; empty: "
            "the system's).",
            group="cache",
        ),
    )

    # --- input limits
    max_request_candidates: int = field(
        default=100,
        metadata=_opt("Most candidates one request may carry.", minimum=1, group="limits"),
    )
    max_query_chars: int = field(
        default=4096,
        metadata=_opt("Longest query or instruction, in characters.", minimum=1, group="limits"),
    )
    max_document_chars: int = field(
        default=131_072,
        metadata=_opt(
            "Longest candidate text or title, in characters. Long documents are fine: only "
            "their best chunk is scored.",
            minimum=1,
            group="limits",
        ),
    )
    max_id_chars: int = field(
        default=512,
        metadata=_opt(
            "Longest candidate id or request id, in characters.", minimum=1, group="limits"
        ),
    )
    max_metadata_entries: int = field(
        default=32,
        metadata=_opt("Most metadata entries on one candidate.", minimum=0, group="limits"),
    )
    max_metadata_key_chars: int = field(
        default=128,
        metadata=_opt("Longest metadata key, in characters.", minimum=1, group="limits"),
    )
    max_metadata_value_chars: int = field(
        default=2048,
        metadata=_opt("Longest metadata value, in characters.", minimum=1, group="limits"),
    )
    max_metadata_request_chars: int = field(
        default=262_144,
        metadata=_opt(
            "Metadata keys and values of all of a request's candidates together, in characters.",
            minimum=1,
            group="limits",
        ),
    )

    # --- logging
    log_level: str = field(
        default="info", metadata=_opt("Log level: debug, info, warning, error.", group="logging")
    )
    log_format: LogFormat = field(
        default=LogFormat.AUTO,
        metadata=_opt(
            "json, console, or auto (JSON unless stdout is a terminal).", group="logging"
        ),
    )

    # --- metrics and traces (docs/observability.md)
    metrics: bool = field(
        default=True,
        metadata=_opt("Serve Prometheus metrics over HTTP at /metrics.", group="observability"),
    )
    metrics_host: str = field(
        default="",
        metadata=_opt(
            "Address of the metrics endpoint (empty: the same as --host).", group="observability"
        ),
    )
    metrics_port: int = field(
        default=9464,
        metadata=_opt(
            "Port of the metrics endpoint (0 picks a free one).",
            minimum=0,
            maximum=65535,
            group="observability",
        ),
    )
    trace_backend_calls: bool = field(
        default=False,
        metadata=_opt(
            "With tracing on, one client span per backend HTTP call (a 40-candidate chat "
            "request makes 40). Off: calls carry the traceparent of the span that carries the "
            "request's scoring, so a traced backend still joins the trace, at a fraction of "
            "the cost.",
            group="observability",
        ),
    )
    trace_steps: bool = field(
        default=False,
        metadata=_opt(
            "With tracing on, a span for each CPU-only step of a request (rerank.validate, "
            "rerank.shape, rerank.chunk, rerank.blend) and rerank.score. Off: one span per "
            "Rerank call or JSON API request, the server span, which carries the scoring's "
            "attributes (RerankStream and RerankBatch requests keep rerank.score).",
            group="observability",
        ),
    )
    otlp_endpoint: str = field(
        default="",
        metadata=_opt(
            "OTLP/gRPC collector for traces and metrics, e.g. http://otel-collector:4317 "
            "(empty: OTEL_EXPORTER_OTLP_ENDPOINT if set, else no export and no tracing).",
            group="observability",
        ),
    )

    health_interval_s: float = field(
        default=5.0,
        metadata=_opt(
            "How often each backend instance's --health-path is polled; a backend coming up "
            "is probed.",
            minimum=0.1,
            group="backend",
        ),
    )
    probe: bool = field(
        default=True,
        metadata=_opt(
            "Score a relevant and an irrelevant pair whenever the backend comes up, and warn "
            "when the model cannot tell them apart.",
            group="backend",
        ),
    )

    # --- managed llama-server (docs/configuration.md, "Managed mode")
    managed: bool = field(
        default=False,
        metadata=_opt(
            "Start and supervise a local llama-server (ignores --backend-url).", group="managed"
        ),
    )
    llama_server: str = field(
        default="",
        metadata=_opt(
            "llama-server binary for managed mode (empty: on PATH, else built into the cache).",
            group="managed",
        ),
    )
    model_path: str = field(
        default="",
        metadata=_opt(
            "GGUF model for managed mode, a file or hf:ORG/REPO[/FILE.gguf] (empty: "
            "MiniLM-L6, prepared in the cache).",
            group="managed",
        ),
    )
    llama_slots: int = field(
        default=0,
        metadata=_opt(
            "llama-server parallel slots (-np); 0 means --concurrency.", minimum=0, group="managed"
        ),
    )
    llama_ctx_per_slot: int = field(
        default=2048,
        metadata=_opt(
            "Context tokens per slot (-c is slots x this).", minimum=256, group="managed"
        ),
    )
    llama_args: str = field(
        default="",
        metadata=_opt(
            'Extra llama-server arguments, shell-quoted (e.g. "-t 4 --mlock"). Managed mode '
            "adds --cache-ram 0 (no host-memory prompt cache) unless these or "
            "LLAMA_ARG_CACHE_RAM set it.",
            group="managed",
        ),
    )
    llama_ready_timeout_s: float = field(
        default=120.0,
        metadata=_opt(
            "How long to wait for a (re)started llama-server to load its model; a restart that "
            "is not ready by then is killed and tried again.",
            minimum=1,
            group="managed",
        ),
    )
    managed_backend: ManagedBackend = field(
        default=ManagedBackend.AUTO,
        metadata=_opt(
            "How managed mode scores: auto reads the model's GGUF metadata and scores a "
            "reranker (Qwen3-Reranker, a rank head) by the path measured fastest, completion; "
            "any other model by --backend. chat, completion, or rerank (llama-server "
            '--rerank, for a GGUF with a rank head) choose. docs/backends.md, "Reranker '
            'models in managed mode".',
            group="managed",
        ),
    )
    llama_amx: LlamaAmx = field(
        default=LlamaAmx.AUTO,
        metadata=_opt(
            "llama.cpp's AMX kernels, which crash the pinned build on Intel Xeon 4th generation "
            "and later: auto (the cache's build is compiled without them; another llama-server "
            "gets LLAMA_ARG_REPACK=0 where the CPU has AMX; one killed by a CPU fault gets it "
            "from its next launch), on (built with them, nothing passed), off (built without "
            'them, LLAMA_ARG_REPACK=0 always). docs/backends.md, "CPUs with AMX".',
            group="managed",
        ),
    )
    cache_dir: Path = field(
        default_factory=default_cache_dir,
        metadata=_opt(
            "Where prepared assets (llama-server build, models, logs) are kept.", group="managed"
        ),
    )
    # --- several models (model_specs.py)
    models: str = field(
        default="",
        metadata=_opt(
            "Models served by name: NAME=SOURCE entries separated by spaces, as "
            "--model NAME=SOURCE (which replaces these when given).",
            group="models",
        ),
    )
    models_file: str = field(
        default="",
        metadata=_opt(
            "TOML file of models and their own settings (source, aliases, backend, "
            "concurrency, instruction, blend profile, ...; docs/models.md).",
            group="models",
        ),
    )
    default_model: str = field(
        default="",
        metadata=_opt(
            "With several models: the one a request naming none, or naming one not served, "
            "gets (empty: no name gets the first model, an unknown name 404 / NOT_FOUND).",
            group="models",
        ),
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            kind = type(_default(f))
            if issubclass(kind, Enum) and not isinstance(value, kind):
                # Settings(backend="chat") in code gets the same check as the flag.
                value = _convert(kind, str(value), f"{flag_name(f.name)} / {env_name(f.name)}")
                object.__setattr__(self, f.name, value)
            lo, hi = f.metadata.get("minimum"), f.metadata.get("maximum")
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if not math.isfinite(value):  # nan passes every bound check; built in code
                raise ConfigError(
                    f"{flag_name(f.name)} / {env_name(f.name)}: must be a "
                    f"finite number, got {value}"
                )
            if (lo is not None and value < lo) or (hi is not None and value > hi):
                bounds = f">= {lo}" if hi is None else f"between {lo} and {hi}"
                raise ConfigError(
                    f"{flag_name(f.name)} / {env_name(f.name)}: must be {bounds}, got {value}"
                )
        if self.log_level.lower() not in {"debug", "info", "warning", "error"}:
            raise ConfigError(
                f"--log-level / {env_name('log_level')}: unknown level {self.log_level!r}"
            )
        for url in self.backend_urls:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(
                    f"--backend-url / {env_name('backend_url')}: each URL must "
                    f"start with http:// or https://, got {url!r}"
                )
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError(
                "--tls-cert / RERANK_TLS_CERT and --tls-key / RERANK_TLS_KEY go together"
            )
        if self.tls_client_ca and not self.tls_cert:
            raise ConfigError(
                "--tls-client-ca / RERANK_TLS_CLIENT_CA needs --tls-cert and --tls-key"
            )
        if self.http_port and self.http_port == self.port:
            raise ConfigError("--http-port / RERANK_HTTP_PORT: must differ from --port")
        if (
            self.metrics
            and self.metrics_port
            and self.metrics_host in ("", self.host)
            and self.metrics_port in (self.port, self.http_port)
        ):
            # Else the clash would be reported as another program holding --port.
            raise ConfigError(
                "--metrics-port / RERANK_METRICS_PORT: must differ from --port and --http-port"
            )
        try:
            shlex.split(self.llama_args)
        except ValueError as exc:  # checked now, not after minutes of building assets
            raise ConfigError(
                f"--llama-args / {env_name('llama_args')}: cannot split it into arguments ({exc})"
            ) from None
        if self.backend in (BackendKind.OLLAMA, BackendKind.LLM) and not self.model:
            raise ConfigError(
                f"--model / {env_name('model')}: the {self.backend} backend needs a model name"
            )

    @property
    def outbound_key(self) -> str:
        """The key sent to the backend: --backend-api-key, else the deprecated --api-key."""
        return self.backend_api_key or self.api_key

    @property
    def backend_urls(self) -> list[str]:
        return [u.strip() for u in self.backend_url.split(",") if u.strip()]

    @property
    def address(self) -> str:
        return host_port(self.host, self.port)


def host_port(host: str, port: int) -> str:
    """`host:port`, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _field_type(f: dataclasses.Field[Any]) -> type[Any]:
    return type(_default(f))


def setting_type(name: str) -> type[Any]:
    """The type of the setting `name` (its default's)."""
    return _field_type(next(f for f in dataclasses.fields(Settings) if f.name == name))


def read_value(name: str, raw: str, source: str) -> Any:
    """`raw` read as the setting `name` is (`source` names where it came from in errors)."""
    return _convert(setting_type(name), raw, source)


def _convert(kind: type[Any], raw: str, source: str) -> Any:
    try:
        if kind is bool:
            lowered = raw.strip().lower()
            if lowered in {"1", "true", "yes", "on"}:
                return True
            if lowered in {"0", "false", "no", "off"}:
                return False
            raise ValueError(raw)
        if issubclass(kind, Enum):
            return kind(raw.strip().lower())
        if issubclass(kind, Path):  # the default's type: PosixPath
            if not raw.strip():  # Path("") is the working directory, never what was meant
                raise ValueError(raw)
            return Path(raw).expanduser()
        value = kind(raw)
        if kind is float and not math.isfinite(value):  # nan passes every bound check
            raise ValueError(raw)
        return value
    except ValueError:
        choices = ""
        if issubclass(kind, Enum):
            choices = f"; choose from {', '.join(m.value for m in kind)}"
        raise ConfigError(f"{source}: cannot read {raw!r} as {kind.__name__}{choices}") from None


def _flag_converter(kind: type[Any], name: str) -> Callable[[str], Any]:
    def convert(raw: str) -> Any:
        try:
            return _convert(kind, raw, flag_name(name))
        except ConfigError as exc:
            # argparse reports this as a usage error naming the flag, exit code 2.
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults beside each flag; the epilog (the subcommands) printed as written."""


def build_parser(
    prog: str = "rerank-server", environ: Mapping[str, str] | None = None, epilog: str | None = None
) -> argparse.ArgumentParser:
    """The parser for every setting; defaults shown are those in force (variables applied)."""
    environ = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Asynchronous gRPC reranking service. Every flag can also be set "
        f"through the environment variable named beside it ({ENV_PREFIX}*).",
        epilog=epilog,
        formatter_class=_HelpFormatter,
    )
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in dataclasses.fields(Settings):
        meta = f.metadata
        group = groups.get(meta["group"]) or groups.setdefault(
            meta["group"], parser.add_argument_group(meta["group"])
        )
        kind = _field_type(f)
        env = env_name(f.name)
        default = _from_variable(kind, environ[env], env) if env in environ else _default(f)
        help_text = f"{meta['help']} [env {env}]"
        if kind is bool:
            group.add_argument(
                flag_name(f.name),
                dest=f.name,
                default=default,
                help=help_text,
                action=argparse.BooleanOptionalAction,
            )
            continue
        choices = [m.value for m in kind] if issubclass(kind, Enum) else None
        if f.name == "model":  # repeatable: `load` sorts NAME=SOURCE from a plain NAME
            group.add_argument(
                flag_name(f.name), dest=f.name, default=None, help=help_text, action="append"
            )
            continue
        group.add_argument(
            flag_name(f.name),
            dest=f.name,
            default=default,
            help=help_text,
            choices=choices,
            metavar=f.name.upper() if choices is None else None,
            type=_flag_converter(kind, f.name),
        )
    return parser


def load(
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    parser: argparse.ArgumentParser | None = None,
) -> Settings:
    """Settings from flags and `RERANK_*` variables; raises ConfigError on a bad value."""
    environ = os.environ if environ is None else environ
    parser = parser or build_parser(environ=environ)
    namespace = parser.parse_args(argv)
    values = {f.name: getattr(namespace, f.name) for f in dataclasses.fields(Settings)}
    _sort_model_flags(values, environ)
    _backend_chooses_managed_path(values, argv, environ)
    for value in values.values():
        if isinstance(value, _Unreadable):  # no flag was given in its place
            raise value.error
    return Settings(**values)


def _sort_model_flags(values: dict[str, Any], environ: Mapping[str, str]) -> None:
    """`--model` as given: NAME=SOURCE entries become `models` (replacing
    RERANK_MODELS), one plain NAME is `model`; not given, RERANK_MODEL or the default."""
    given: list[str] | None = values["model"]
    if given is None:
        values["model"] = environ.get(env_name("model"), "")
        return
    names = [g for g in given if "=" not in g]
    if len(names) > 1:
        raise ConfigError(
            f"--model: {len(names)} plain names given ({', '.join(names)}); a plain NAME "
            "is the backend's model name, NAME=SOURCE serves a model by name"
        )
    values["model"] = names[0] if names else environ.get(env_name("model"), "")
    if entries := [g for g in given if "=" in g]:
        # Each ended by NUL, which no environment variable can hold: see model_specs.
        values["models"] = "".join(f"{e}{FLAG_ENTRY_END}" for e in entries)


def _backend_chooses_managed_path(
    values: dict[str, Any], argv: Sequence[str] | None, environ: Mapping[str, str]
) -> None:
    """In managed mode an operator's own `--backend` wins over the model's metadata, as
    `--managed-backend` does (when that is not given too)."""
    if not (_given("backend", argv, environ) and not _given("managed_backend", argv, environ)):
        return
    backend = values["backend"]
    if isinstance(backend, _Unreadable):
        return
    if (chosen := managed_path_of(backend)) is not None:
        values["managed_backend"] = chosen


def managed_path_of(backend: BackendKind) -> ManagedBackend | None:
    """The managed scoring path an explicit `backend` chooses (None: not one of them)."""
    return next((m for m in ManagedBackend if m.value == backend.value), None)


def _given(name: str, argv: Sequence[str] | None, environ: Mapping[str, str]) -> bool:
    """Whether the setting was set by its flag or its variable (not left at its default)."""
    flag = flag_name(name)
    args = sys.argv[1:] if argv is None else argv
    return env_name(name) in environ or any(a == flag or a.startswith(flag + "=") for a in args)


@dataclass(frozen=True, slots=True)
class _Unreadable:
    """A variable's value that does not read as its setting's type: its error is raised
    only if no flag replaces it, as a flag wins over the variable (and `--help` still
    prints, showing the value as it is). Not a str: argparse would pass a str default
    through the flag's converter, and name the flag for the variable's mistake."""

    raw: str
    error: ConfigError

    def __str__(self) -> str:
        return self.raw


def _from_variable(kind: type[Any], raw: str, env: str) -> Any:
    try:
        return _convert(kind, raw, env)
    except ConfigError as exc:
        return _Unreadable(raw, exc)
