"""Managed mode's supervision of a real llama-server that does not exit but stops
working: wedged while running, or stuck on a restart. Both used to stay that way for
ever (only an exit brought a restart), every request degraded meanwhile."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import structlog

from rerank_server.managed.llama_server import ManagedLlamaServer
from tests.real.conftest import assets_or_fail
from tests.waiting import eventually


async def _healthy(managed: ManagedLlamaServer, not_pid: int) -> bool:
    """Whether a llama-server other than `not_pid` answers the managed URL's /health."""
    if managed.pid in (None, not_pid):
        return False
    try:
        async with httpx.AsyncClient(timeout=1) as http:
            return (await http.get(managed.url + "/health")).status_code == 200
    except httpx.HTTPError:
        return False


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@contextlib.asynccontextmanager
async def _started(binary: Path, tmp_path: Path,
                   **timing: float) -> AsyncIterator[ManagedLlamaServer]:
    _, model = assets_or_fail()
    managed = ManagedLlamaServer(binary, model, slots=1, ctx_per_slot=512,
                                 log_path=tmp_path / "llama-server.log", **timing)
    await managed.start()
    try:
        yield managed
    finally:
        await managed.stop()


async def test_a_wedged_llama_server_is_killed_and_restarted(tmp_path: Path) -> None:
    """Stopped with SIGSTOP, a running llama-server answers nothing while its process
    lives on: after `unresponsive_after_s` without a healthy /health it is killed and a
    new one serves on the same URL."""
    binary, _ = assets_or_fail()
    async with _started(binary, tmp_path, liveness_every_s=0.5,
                        unresponsive_after_s=2) as managed:
        wedged = managed.pid
        assert wedged is not None
        with structlog.testing.capture_logs() as logged:
            os.kill(wedged, signal.SIGSTOP)
            assert await eventually(lambda: _healthy(managed, wedged), 60, poll_s=0.2)
        assert _gone(wedged)
        assert managed.restarts == 1
        [event] = [e for e in logged if e["event"] == "llama_server_unresponsive"]
        assert event["pid"] == wedged and event["silent_s"] >= 2


async def test_a_restart_that_never_gets_ready_is_killed_and_tried_again(
        tmp_path: Path) -> None:
    """The first restart hangs before it listens (here: a wrapper that sleeps instead of
    starting llama-server on its second launch): killed after the ready timeout, then
    the next restart serves."""
    binary, _ = assets_or_fail()
    wrapper = tmp_path / "llama-server"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = --help ]; then exec "{binary}" --help; fi\n'  # not a launch
        f'n=$(cat "{tmp_path}/launches" 2>/dev/null || echo 0)\n'
        f'echo $((n + 1)) > "{tmp_path}/launches"\n'
        'if [ "$n" = 1 ]; then exec sleep 600; fi\n'
        f'exec "{binary}" "$@"\n')
    wrapper.chmod(0o755)
    async with _started(wrapper, tmp_path, ready_timeout_s=5) as managed:
        first = managed.pid
        assert first is not None
        with structlog.testing.capture_logs() as logged:
            os.kill(first, signal.SIGKILL)
            assert await eventually(lambda: _healthy(managed, first), 60, poll_s=0.2)
        [stuck] = [e for e in logged if e["event"] == "llama_server_not_ready"]
        assert _gone(stuck["pid"])
        assert (tmp_path / "launches").read_text().strip() == "3"
        assert managed.restarts == 2
