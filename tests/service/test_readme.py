"""The README's Python blocks run as pasted, against a real server (its address swapped in)."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rerank_server.server import RunningServer

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
README_ADDRESS = "127.0.0.1:50051"


def test_readme_has_python_to_run() -> None:
    assert BLOCKS, "the README lost its Python example"


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
async def test_readme_python_block_runs(server: RunningServer, code: str) -> None:
    assert README_ADDRESS in code
    script = code.replace(README_ADDRESS, f"127.0.0.1:{server.port}")
    proc = await asyncio.to_thread(subprocess.run, [sys.executable, "-c", script],
                                   capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 + 3 + 1  # top_k=2 results, then 3 streamed results and a summary
    assert lines[0].startswith("1 ") and lines[2] == "1"
