"""The README's Python blocks run as pasted, against a real server (its ports swapped in)."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rerank_server.managed.child_process import free_port
from rerank_server.server import RunningServer
from tests.conftest import StartServer

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
GRPC_ADDRESS = "127.0.0.1:50051"
HTTP_ADDRESS = "127.0.0.1:50052"


@pytest.fixture
async def both_apis(start_server: StartServer) -> RunningServer:
    return await start_server(http_port=free_port())


CLIENT_README = README.parent / "clients" / "python" / "README.md"
CLIENT_FIRST = re.findall(r"```python\n(.*?)```", CLIENT_README.read_text(), re.DOTALL)[0]


async def test_the_client_readmes_first_example_reranks(server: RunningServer) -> None:
    """It sent two documents, under the server's `--min-candidates` of three: what it
    printed was retrieval order and `too_few_candidates`, never a reranker score."""
    script = CLIENT_FIRST.replace(GRPC_ADDRESS, f"127.0.0.1:{server.port}")
    proc = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    result, summary = proc.stdout.splitlines()
    assert result.startswith("1 ") and not result.endswith(" None")  # a reranker score
    assert summary == "True None"


def test_readme_has_python_for_both_apis() -> None:
    assert any(GRPC_ADDRESS in b for b in BLOCKS) and any(HTTP_ADDRESS in b for b in BLOCKS)


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
async def test_readme_python_block_runs(both_apis: RunningServer, code: str) -> None:
    script = code.replace(GRPC_ADDRESS, f"127.0.0.1:{both_apis.port}").replace(
        HTTP_ADDRESS, f"127.0.0.1:{both_apis.http_port}"
    )
    proc = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    if GRPC_ADDRESS in code:
        assert len(lines) == 2 + 3 + 1  # top_k=2 results, then 3 streamed and a summary
        assert lines[0].startswith("1 ") and lines[2] == "1"
    else:
        assert "relevance_score" in proc.stdout
