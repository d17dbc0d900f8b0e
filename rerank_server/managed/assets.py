"""`rerank-server prepare`: managed mode's assets in the cache (llama-server, the models).

What comes from where, and how a run survives interruption: docs/architecture.md.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..observability import logs
from ..settings import LlamaAmx, default_cache_dir, env_name
from . import hub
from .converted import (
    MINILM_WHEEL,
    SPEED_TWIN_TYPES,
    embedding_model_path,
    prepare_embedding_model,
    prepare_rank_head_model,
    prepare_speed_twin,
)
from .downloads import (
    SMOLLM2_WHEEL,
    STAND_IN_MODEL,
    AssetError,
    prepare_model,
    say,
    sha256_of,
)
from .llama_build import (
    LLAMA_CPP_SOURCE,
    BrokenBinary,
    build_llama_server,
    cached_llama_server,
    llama_server_version,
    resolve_llama_server,
)


@dataclass(frozen=True)
class Assets:
    """What managed mode runs: the llama-server binary, its version, and the model."""

    llama_server: Path
    llama_server_version: str
    model: Path


def resolve_model(
    explicit: Path | str | None, cache: Path, fetch_missing: bool, verify: bool = False
) -> Path:
    """The model to run: the file given, one fetched from the hub (`hf:ORG/REPO/FILE`),
    or the embedded default, MiniLM-L6 for the `embedding` backend (made in the cache
    when missing and `fetch_missing`)."""
    if explicit is not None and str(explicit).startswith("hf:"):
        return hub.fetch(hub.HubSource.parse(str(explicit)), cache)
    if explicit is not None:
        path = Path(explicit).expanduser()
        if not path.is_file():
            raise AssetError(f"--model-path {path}: no such file")
        return path
    target = embedding_model_path(cache)
    if target.exists() or fetch_missing:
        return prepare_embedding_model(cache)
    raise AssetError(
        f"no model at {target}: run `make assets` (or `rerank-server "
        "prepare`), or pass --model-path FILE.gguf"
    )


def resolve_stand_in(cache: Path, fetch_missing: bool, verify: bool = False) -> Path:
    """SmolLM2-135M-Instruct, the small chat model the tests of the `chat` and
    `completion` paths run (`prepare --chat-model`)."""
    target = cache / "models" / STAND_IN_MODEL.name
    if target.exists() or fetch_missing:
        return prepare_model(cache, verify=verify)
    raise AssetError(f"no chat model at {target}: run `make test-assets`")


@contextlib.contextmanager
def cache_lock(cache: Path) -> Iterator[None]:
    """Held while assets are prepared, so that runs sharing a cache (`make run` beside
    `make test-assets`, two servers starting) take turns instead of building and
    downloading into the same temporary paths together. A cache that cannot hold the lock
    file (read-only, prepared in an image) is only read, and needs none."""
    try:
        cache.mkdir(parents=True, exist_ok=True)
        handle = (cache / ".lock").open("a")
    except OSError:
        handle = None
    if handle is None:
        yield
        return
    with handle:  # closing it releases the lock, as does the process ending
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another run preparing {cache} to finish")
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def prepare(
    cache: Path,
    llama_server: Path | None = None,
    model: Path | str | None = None,
    chat: bool = False,
    rank_head: bool = False,
    amx_mode: LlamaAmx = LlamaAmx.AUTO,
    speed_twin: Sequence[str] = (),
) -> Assets:
    """Everything managed mode needs (with `chat`, the SmolLM2 chat model; with
    `rank_head`, MiniLM with an untrained rank head for `llama-server --rerank`); prints
    what it did and records it in manifest.json."""
    with cache_lock(cache):
        return _prepare(cache, llama_server, model, chat, rank_head, amx_mode, speed_twin)


def _prepare(
    cache: Path,
    llama_server: Path | None,
    model: Path | str | None,
    chat: bool,
    rank_head: bool,
    amx_mode: LlamaAmx,
    speed_twin: Sequence[str] = (),
) -> Assets:
    say(f"cache: {cache}")
    cached = cached_llama_server(cache, amx_mode)
    built_before = cached.exists()
    binary = resolve_llama_server(llama_server, cache, build=True, amx_mode=amx_mode)
    try:
        version = llama_server_version(binary)
    except BrokenBinary as exc:
        # Only the cache's own build, found there, and damaged: an operator's binary is
        # theirs to mend, one just built would fail the same way again, and a machine
        # that cannot run it (noexec) gains nothing from minutes of building.
        if binary != cached or not built_before or not exc.damaged:
            raise
        say(f"{exc}; building it again")
        try:
            binary.unlink()
        except OSError as gone:
            raise AssetError(f"{exc}, and it cannot be removed: {gone.strerror}") from None
        binary = build_llama_server(cache, amx_mode=amx_mode)
        version = llama_server_version(binary)
    say(f"llama-server: {binary} (version {version})")
    model_path = resolve_model(model, cache, fetch_missing=True, verify=True)
    say(f"model: {model_path} ({model_path.stat().st_size} bytes)")
    manifest: dict[str, Any] = {
        "llama_server": {
            "path": str(binary),
            "version": version,
            "llama_amx": amx_mode,
            "source": f"{LLAMA_CPP_SOURCE.project}=={LLAMA_CPP_SOURCE.version}",
            "source_sha256": LLAMA_CPP_SOURCE.sha256,
        },
        "model": {"path": str(model_path), "sha256": sha256_of(model_path)},
    }
    minilm = f"{MINILM_WHEEL.project}=={MINILM_WHEEL.version}"
    if model is None:
        manifest["model"].update(source=minilm, converter="rerank_server/managed/bert_gguf.py, f16")
    if chat:
        stand_in = resolve_stand_in(cache, fetch_missing=True, verify=True)
        say(f"chat model: {stand_in} ({stand_in.stat().st_size} bytes)")
        manifest["chat_model"] = {
            "path": str(stand_in),
            "name": STAND_IN_MODEL.name,
            "source": f"{SMOLLM2_WHEEL.project}=={SMOLLM2_WHEEL.version}",
            "member": STAND_IN_MODEL.member,
            "sha256": STAND_IN_MODEL.sha256,
        }
    if rank_head:
        manifest["rank_head_model"] = _converted(
            "rank-head model",
            prepare_rank_head_model(cache),
            f"{minilm} with an untrained one-logit classification head (torch seed 0, "
            "normal std 0.05)",
        )
    if speed_twin:
        manifest["speed_twin"] = {
            path.name: {
                "path": str(path),
                "sha256": sha256_of(path),
                "made_by": "rerank_server/managed/speed_twin.py: Qwen3-0.6B sizes, "
                "random weights (seed 0), SmolLM2's tokenizer",
            }
            for path in prepare_speed_twin(cache, speed_twin, binary, amx_mode)
        }
    cache.mkdir(parents=True, exist_ok=True)
    (cache / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    say("ready")
    return Assets(binary, version, model_path)


def _converted(what: str, path: Path, source: str) -> dict[str, str]:
    """A GGUF converted by llama.cpp's converter: said, and its manifest entry."""
    say(f"{what}: {path} ({path.stat().st_size} bytes)")
    return {
        "path": str(path),
        "sha256": sha256_of(path),
        "source": source,
        "converter": f"convert_hf_to_gguf.py from {LLAMA_CPP_SOURCE.project}=="
        f"{LLAMA_CPP_SOURCE.version}, --outtype f16",
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="rerank-server prepare",
        description="Build or find llama-server and prepare the models into the cache.",
    )
    # As the server reads it: an empty RERANK_CACHE_DIR is refused, not the default.
    from_env = os.environ.get("RERANK_CACHE_DIR")
    if from_env is not None and not from_env.strip():
        print(
            "rerank-server prepare: error: RERANK_CACHE_DIR is empty; unset it for the "
            f"default ({default_cache_dir()})",
            file=sys.stderr,
        )
        return 2
    parser.add_argument("--cache-dir", type=Path, default=Path(from_env or default_cache_dir()))
    parser.add_argument(
        "--llama-server", type=Path, default=os.environ.get("RERANK_LLAMA_SERVER") or None
    )
    parser.add_argument(
        "--model-path",
        default=os.environ.get("RERANK_MODEL_PATH") or None,
        help="a GGUF file, or hf:ORG/REPO[/FILE.gguf] to fetch (default: MiniLM-L6)",
    )
    parser.add_argument(
        "--embedding-model",
        action="store_true",
        help="MiniLM-L6 for the embedding backend: the default model, always prepared",
    )
    parser.add_argument(
        "--chat-model",
        action="store_true",
        help="also fetch SmolLM2-135M-Instruct, the small chat model of the tests of the "
        "chat and completion paths",
    )
    parser.add_argument(
        "--rank-head-model",
        action="store_true",
        help="also build MiniLM-L6 with an untrained rank head for "
        "`llama-server --rerank` (tests of the rerank backend)",
    )
    parser.add_argument(
        "--speed-twin",
        default="",
        metavar="TYPES",
        help="also write a Qwen3-Reranker-0.6B speed twin (random weights) "
        f"in these types, comma-separated, of {', '.join(SPEED_TWIN_TYPES)} "
        "(docs/benchmarks.md)",
    )
    amx_variable = env_name("llama_amx")
    parser.add_argument(
        "--llama-amx",
        choices=list(LlamaAmx),
        default=None,
        help="auto and off build llama-server without llama.cpp's AMX "
        f"kernels, on with them ({amx_variable}; docs/backends.md)",
    )
    args = parser.parse_args(argv)
    raw = args.llama_amx or os.environ.get(amx_variable) or LlamaAmx.AUTO
    if raw not in list(LlamaAmx):
        parser.error(f"{amx_variable}={raw}: choose from {', '.join(LlamaAmx)}")
    twin = [k.strip() for k in args.speed_twin.split(",") if k.strip()]
    if any(k not in SPEED_TWIN_TYPES for k in twin):
        parser.error(f"--speed-twin {args.speed_twin}: choose from {', '.join(SPEED_TWIN_TYPES)}")
    # A fetch's `model_download` events: JSON on stdout unless it is a terminal.
    logs.configure()
    try:
        prepare(
            args.cache_dir.expanduser(),
            args.llama_server,
            args.model_path,
            chat=args.chat_model,
            rank_head=args.rank_head_model,
            amx_mode=LlamaAmx(raw),
            speed_twin=twin,
        )
    except AssetError as exc:
        print(f"rerank-server prepare: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nrerank-server prepare: interrupted; run it again to resume", file=sys.stderr)
        return 130
    return 0
