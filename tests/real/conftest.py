"""A real llama-server with the stand-in model, started once per test session.

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

from rerank_server import assets, settings
from rerank_server.managed import free_port

SLOTS = 4


@dataclass(frozen=True)
class RealLlama:
    url: str
    binary: Path
    model: Path
    process: subprocess.Popen[bytes]


def _assets() -> tuple[Path, Path]:
    cache = settings.load([]).cache_dir  # honours RERANK_CACHE_DIR, as `make assets` does
    explicit = os.environ.get("RERANK_LLAMA_SERVER")
    try:
        binary = assets.resolve_llama_server(Path(explicit) if explicit else None, cache,
                                             build=False)
        model = assets.resolve_model(None, cache, fetch_missing=False)
    except assets.AssetError as exc:
        pytest.fail(f"real-backend assets missing: {exc}", pytrace=False)
    return binary, model


@pytest.fixture(scope="session")
def real_llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealLlama]:
    binary, model = _assets()
    port = free_port()
    log = tmp_path_factory.mktemp("llama") / "llama-server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
             "-np", str(SLOTS), "-c", str(SLOTS * 2048), "--no-webui"],
            stdout=out, stderr=subprocess.STDOUT)
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
