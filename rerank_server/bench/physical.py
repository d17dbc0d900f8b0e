"""The physical limit beside a model result: the same weights and tokens in eager PyTorch,
tokenized by the backend's own tokenizer (`/tokenize`), run by `eager.py`.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

SCRIPT = Path(__file__).with_name("eager.py")


def torch_python(cache: Path) -> Path | None:
    """A Python that can run `eager.py`, or None."""
    if importlib.util.find_spec("torch") and importlib.util.find_spec("gguf"):
        return Path(sys.executable)
    converter = cache / "convert-venv" / "bin" / "python"
    return converter if converter.exists() else None


async def prompt_tokens(
    http: httpx.AsyncClient, url: str, prompts: Sequence[str]
) -> list[list[int]]:
    """Each prompt as the backend's tokenizer splits it, special tokens parsed."""

    async def one(text: str) -> list[int]:
        answer = await http.post(url + "/tokenize", json={"content": text})
        answer.raise_for_status()
        return [int(t) for t in answer.json()["tokens"]]

    return list(await asyncio.gather(*(one(p) for p in prompts)))


async def eager_limit(
    python: Path, model: Path, tokens: Sequence[Sequence[int]], rounds: int
) -> dict[str, Any]:
    """`eager.py`'s report for `model` over `tokens`: device, dtype, pairs/s. Raises
    RuntimeError with the script's last words when it fails."""
    proc = await asyncio.create_subprocess_exec(
        str(python),
        str(SCRIPT),
        str(model),
        str(max(rounds, 1)),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate(json.dumps([list(t) for t in tokens]).encode())
    if proc.returncode:
        tail = err.decode(errors="replace").strip().splitlines()[-3:]
        raise RuntimeError(f"eager.py exited with {proc.returncode}: {' | '.join(tail)}")
    report: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return report
