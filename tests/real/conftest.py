"""Real llama-servers, started once per test session: the stand-in chat model, and
MiniLM-L6 for embeddings.

The assets come from `make assets` (`rerank-server prepare`). When they are missing the
suite fails and says so; it is never skipped.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from rerank_server import settings
from rerank_server.managed import assets, converted, downloads, foreground, llama_build
from rerank_server.managed.llama_server import ManagedLlamaServer

SLOTS = 4


@dataclass(frozen=True)
class RealLlama:
    url: str
    binary: Path
    model: Path
    process: subprocess.Popen[bytes]


def assets_or_fail() -> tuple[Path, Path]:
    loaded = settings.load([])  # honours RERANK_CACHE_DIR, as `make assets` does
    cache = loaded.cache_dir
    explicit = os.environ.get("RERANK_LLAMA_SERVER")
    try:
        binary = llama_build.resolve_llama_server(
            Path(explicit) if explicit else None, cache, build=False, amx_mode=loaded.llama_amx
        )
        model = assets.resolve_stand_in(cache, fetch_missing=False)
    except downloads.AssetError as exc:
        pytest.fail(f"real-backend assets missing: {exc}", pytrace=False)
    return binary, model


@pytest.fixture(scope="session")
def real_llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealLlama]:
    binary, model = assets_or_fail()
    yield from _serve(binary, model, tmp_path_factory, ["-np", str(SLOTS), "-c", str(SLOTS * 2048)])


@pytest.fixture(scope="session")
def real_embedding(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealLlama]:
    """llama-server serving MiniLM-L6 on /v1/embeddings (mean pooling, as trained)."""
    binary, _ = assets_or_fail()
    model = converted.embedding_model_path(settings.load([]).cache_dir)
    if not model.exists():
        pytest.fail(f"real-backend assets missing: {model}; run `make assets`", pytrace=False)
    yield from _serve(
        binary,
        model,
        tmp_path_factory,
        ["--embedding", "--pooling", "mean", "-np", "2", "-c", "1024", "-b", "512", "-ub", "512"],
    )


@pytest.fixture(scope="session")
def real_embedding_small_batch(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RealLlama]:
    """MiniLM-L6 as `real_embedding`, with a physical batch (`-ub 128`) below its 512-token
    slots: llama-server refuses a longer input, naming the batch size."""
    binary, _ = assets_or_fail()
    model = converted.embedding_model_path(settings.load([]).cache_dir)
    yield from _serve(
        binary,
        model,
        tmp_path_factory,
        ["--embedding", "--pooling", "mean", "-np", "2", "-c", "1024", "-b", "512", "-ub", "128"],
    )


@pytest.fixture(scope="session")
def real_rank_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealLlama]:
    """llama-server --rerank serving MiniLM-L6 with an untrained rank head (/v1/rerank)."""
    binary, _ = assets_or_fail()
    model = converted.rank_head_model_path(settings.load([]).cache_dir)
    if not model.exists():
        pytest.fail(f"real-backend assets missing: {model}; run `make test-assets`", pytrace=False)
    yield from _serve(
        binary,
        model,
        tmp_path_factory,
        ["--rerank", "-np", "2", "-c", "1024", "-b", "512", "-ub", "512"],
    )


def _serve(
    binary: Path, model: Path, tmp_path_factory: pytest.TempPathFactory, args: list[str]
) -> Iterator[RealLlama]:
    log = tmp_path_factory.mktemp("llama") / "llama-server.log"
    loaded = settings.load([])
    with log.open("wb") as out:
        try:
            with foreground.llama_server(
                binary, model, args, cache=loaded.cache_dir, amx_mode=loaded.llama_amx, output=out
            ) as served:
                yield RealLlama(served.url, binary, model, served.proc)
        except foreground.NotReady as exc:
            pytest.fail(f"llama-server {exc}: {log.read_text()[-2000:]}")


async def healthy(managed: ManagedLlamaServer, not_pid: int) -> bool:
    """Whether a llama-server other than `not_pid` answers the managed URL's /health."""
    if managed.pid in (None, not_pid):
        return False
    try:
        async with httpx.AsyncClient(timeout=1) as http:
            return (await http.get(managed.url + "/health")).status_code == 200
    except httpx.HTTPError:
        return False
