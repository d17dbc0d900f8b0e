"""Real llama-servers, started once per test session: the stand-in chat model, and
MiniLM-L6 for embeddings.

The assets come from `make assets` (`rerank-server prepare`). When they are missing the
suite fails and says so; it is never skipped.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from rerank_server import settings
from rerank_server.managed import amx, assets, converted, downloads, llama_build
from rerank_server.managed.child_process import free_port
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
        model = assets.resolve_model(None, cache, fetch_missing=False)
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
    port = free_port()
    log = tmp_path_factory.mktemp("llama") / "llama-server.log"
    loaded = settings.load([])
    # As managed mode starts it: on a CPU with AMX, kept out of llama.cpp's AMX kernels.
    decision = amx.decide(
        loaded.llama_amx,
        args=args,
        environ=os.environ,
        amx_free_build=llama_build.is_amx_free_build(binary, loaded.cache_dir),
    )
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                str(binary),
                "-m",
                str(model),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--no-webui",
                *args,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=decision.env(os.environ),
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"llama-server exited ({proc.returncode}): {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail("llama-server did not become ready in 120 s")
    yield RealLlama(url, binary, model, proc)
    proc.terminate()
    proc.wait(10)


async def healthy(managed: ManagedLlamaServer, not_pid: int) -> bool:
    """Whether a llama-server other than `not_pid` answers the managed URL's /health."""
    if managed.pid in (None, not_pid):
        return False
    try:
        async with httpx.AsyncClient(timeout=1) as http:
            return (await http.get(managed.url + "/health")).status_code == 200
    except httpx.HTTPError:
        return False
