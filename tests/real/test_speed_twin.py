"""The Qwen3-Reranker-0.6B speed twin (`managed/speed_twin.py`) is what `bench` measures
the real size with: llama-server serves it, and rerank-server scores every pair of it by
`completion` and `chat`, as it would a trained reranker's, rather than degrading."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from rerank_server import settings
from rerank_server.domain import BackendKind
from rerank_server.managed import assets
from tests.conftest import StartServer, client_of
from tests.real.conftest import RealLlama, _serve, assets_or_fail

DOCS = [
    "Rivers turn turbines in a dam.",
    "A cat sat on the mat.",
    "Tides can drive generators.",
    "The stock market fell.",
]


@pytest.fixture(scope="module")
def twin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealLlama]:
    binary, stand_in = assets_or_fail()
    python = settings.load([]).cache_dir / "convert-venv" / "bin" / "python"
    assert python.exists(), "no converter environment: run `make test-assets`"
    out = tmp_path_factory.mktemp("twin") / "twin-lm.q8_0.gguf"
    script = Path(assets.__file__).with_name("speed_twin.py")
    subprocess.run(
        [str(python), str(script), str(stand_in), str(out), "q8_0", "lm"],
        check=True,
        timeout=600,
        capture_output=True,
    )
    yield from _serve(binary, out, tmp_path_factory, ["-np", "2", "-c", "4096"])
    out.unlink()  # half a gigabyte


@pytest.mark.parametrize("backend", [BackendKind.COMPLETION, BackendKind.CHAT])
async def test_every_pair_of_the_twin_is_scored(
    twin: RealLlama, start_server: StartServer, backend: BackendKind
) -> None:
    server = await start_server(
        backend_url=twin.url,
        backend=backend,
        concurrency=2,
        assistant_prefill=False,
        timeout_ms=120_000,
    )
    async with client_of(server) as client:
        answer = await client.rerank("river energy", DOCS, timeout=120)
    assert answer.reranked, answer.summary
    assert answer.summary.scored == len(DOCS) and answer.summary.failed == 0
