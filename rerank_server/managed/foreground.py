"""llama-server started and awaited in the foreground, for tools: `prepare`'s check that
a converted model loads, `bench`'s backends, the test suite's real llama-servers.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from ..settings import LlamaAmx
from . import amx, llama_build
from .child_process import free_port
from .llama_build import how_it_ended

READY_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Served:
    """A llama-server started in the foreground: its URL and its process."""

    url: str  # http://127.0.0.1:PORT
    proc: subprocess.Popen[bytes]


class NotReady(RuntimeError):
    """The process never answered `/health` with 200: `str(exc)` says how it ended."""


def wait_healthy(
    url: str, proc: subprocess.Popen[bytes], timeout_s: float = READY_TIMEOUT_S
) -> None:
    """Return once `url` answers 200; NotReady when `proc` exits first or the time is up."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise NotReady(how_it_ended(proc.returncode))
        with (
            contextlib.suppress(OSError, http.client.HTTPException),
            urllib.request.urlopen(url, timeout=1) as answer,
        ):
            if answer.status == 200:
                return
        time.sleep(0.1)
    raise NotReady(f"was not ready in {timeout_s:.0f} s")


@contextmanager
def llama_server(
    binary: Path,
    model: Path,
    args: Sequence[str],
    *,
    cache: Path,
    amx_mode: LlamaAmx,
    output: IO[bytes] | int = subprocess.DEVNULL,
) -> Iterator[Served]:
    """`binary` serving `model` with `args` on a free loopback port, once healthy
    (NotReady otherwise); stopped on the way out. Started as managed mode starts it on
    this CPU (`amx.decide`: out of llama.cpp's AMX kernels where they crash)."""
    port = free_port()
    decision = amx.decide(
        amx_mode,
        args=args,
        environ=os.environ,
        amx_free_build=llama_build.is_amx_free_build(binary, cache),
    )
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
        stdout=output,
        stderr=subprocess.STDOUT,
        env=decision.env(os.environ),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(f"{url}/health", proc)
        yield Served(url, proc)
    finally:
        stop(proc)


def stop(proc: subprocess.Popen[bytes], timeout_s: float = 15) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout_s`."""
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
