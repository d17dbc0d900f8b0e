"""Managed mode's supervision of a real llama-server that does not exit but stops
working: wedged while running, or stuck on a restart. Both used to stay that way for
ever (only an exit brought a restart), every request degraded meanwhile."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import structlog

from rerank_server.errors import StartError
from rerank_server.managed.llama_server import ManagedLlamaServer
from tests.real.conftest import assets_or_fail, healthy
from tests.waiting import eventually


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@contextlib.asynccontextmanager
async def _started(
    binary: Path, tmp_path: Path, **options: float
) -> AsyncIterator[ManagedLlamaServer]:
    _, model = assets_or_fail()
    managed = ManagedLlamaServer(
        binary, model, slots=1, ctx_per_slot=512, log_path=tmp_path / "llama-server.log", **options
    )
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
    async with _started(binary, tmp_path, liveness_every_s=0.5, unresponsive_after_s=2) as managed:
        wedged = managed.pid
        assert wedged is not None
        with structlog.testing.capture_logs() as logged:
            os.kill(wedged, signal.SIGSTOP)
            assert await eventually(lambda: healthy(managed, wedged), 60, poll_s=0.2)
        assert _gone(wedged)
        assert managed.restarts == 1
        [event] = [e for e in logged if e["event"] == "llama_server_unresponsive"]
        assert event["pid"] == wedged and event["silent_s"] >= 2


async def test_a_restart_that_never_gets_ready_is_killed_and_tried_again(tmp_path: Path) -> None:
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
        f'exec "{binary}" "$@"\n'
    )
    wrapper.chmod(0o755)
    async with _started(wrapper, tmp_path, ready_timeout_s=5) as managed:
        first = managed.pid
        assert first is not None
        with structlog.testing.capture_logs() as logged:
            os.kill(first, signal.SIGKILL)
            assert await eventually(lambda: healthy(managed, first), 60, poll_s=0.2)
        [stuck] = [e for e in logged if e["event"] == "llama_server_not_ready"]
        assert _gone(stuck["pid"])
        assert (tmp_path / "launches").read_text().strip() == "3"
        assert managed.restarts == 2


def _wrapper(tmp_path: Path, binary: Path, body: str) -> Path:
    """A `llama-server` script in `tmp_path` that answers `--help` from `binary` and
    launches with `body`."""
    wrapper = tmp_path / "llama-server"
    wrapper.write_text(f'#!/bin/sh\nif [ "$1" = --help ]; then exec "{binary}" --help; fi\n' + body)
    wrapper.chmod(0o755)
    return wrapper


async def test_a_restart_that_cannot_be_launched_is_tried_again(tmp_path: Path) -> None:
    """The binary is gone when llama-server must be restarted (an upgrade replacing it,
    say): the launch fails, is logged and retried with the back-off, and once the binary
    is back the next restart serves. The supervisor used to end with the launch's
    FileNotFoundError, unlogged, and never restart anything again."""
    binary, _ = assets_or_fail()
    wrapper = _wrapper(tmp_path, binary, f'exec "{binary}" "$@"\n')
    async with _started(wrapper, tmp_path) as managed:
        first = managed.pid
        assert first is not None
        with structlog.testing.capture_logs() as logged:
            wrapper.rename(tmp_path / "away")
            os.kill(first, signal.SIGKILL)
            assert await eventually(
                lambda: any(e["event"] == "llama_server_launch_failed" for e in logged), 30
            )
            (tmp_path / "away").rename(wrapper)
            assert await eventually(lambda: healthy(managed, first), 60, poll_s=0.2)
        failed = next(e for e in logged if e["event"] == "llama_server_launch_failed")
        assert "FileNotFoundError" in failed["error"]


async def test_stopping_stops_what_a_wrapper_script_started(tmp_path: Path) -> None:
    """A wrapper that runs llama-server as its child (no `exec`): stopping the managed
    server stops both, so nothing is left serving on the port. Only the wrapper used to
    be signalled, and its llama-server served on."""
    binary, _ = assets_or_fail()
    wrapper = _wrapper(tmp_path, binary, f'"{binary}" "$@"\necho "exited $?"\n')
    async with _started(wrapper, tmp_path) as managed:
        url = managed.url
        assert managed.pid is not None
    async with httpx.AsyncClient(timeout=1) as http:
        with contextlib.suppress(httpx.TransportError):
            await http.get(url + "/health")
            raise AssertionError("llama-server still answers after stop()")


async def test_a_port_taken_while_llama_server_was_down_is_waited_for(tmp_path: Path) -> None:
    """Another program listens on the port while llama-server is down: no launch (it
    could not bind, and the other program's /health would pass for its readiness); once
    the port is free again, a restart serves there."""
    binary, _ = assets_or_fail()
    async with _started(binary, tmp_path) as managed:
        first = managed.pid
        assert first is not None
        with structlog.testing.capture_logs() as logged:
            os.kill(first, signal.SIGKILL)
            assert await eventually(lambda: managed.pid is None, 10)
            squatter = socket.socket()
            squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            with squatter:
                squatter.bind(("127.0.0.1", managed.port))
                squatter.listen()
                assert await eventually(
                    lambda: any(e["event"] == "llama_server_port_taken" for e in logged), 30
                )
            assert await eventually(lambda: healthy(managed, first), 60, poll_s=0.2)


async def test_a_llama_server_that_exits_at_start_is_one_line_with_its_code(tmp_path: Path) -> None:
    """A child that exits straight away is reported as such, with its exit code, at
    once: not as "did not become ready within 120 s"."""
    binary, _ = assets_or_fail()
    wrapper = _wrapper(tmp_path, binary, "exit 3\n")
    with pytest.raises(StartError, match="exited with code 3 while starting"):
        async with _started(wrapper, tmp_path):
            pass


async def test_a_proxy_in_the_environment_does_not_hide_the_child(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HTTP_PROXY (set for the downloads, say) sent the readiness polls of the child on
    127.0.0.1 to the proxy: a healthy llama-server "did not become ready"."""
    with socket.socket() as dead:
        dead.bind(("127.0.0.1", 0))
        monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{dead.getsockname()[1]}")
        binary, _ = assets_or_fail()
        async with _started(binary, tmp_path, ready_timeout_s=30) as managed:
            assert managed.pid is not None


async def test_llama_server_output_is_kept_within_its_cap(tmp_path: Path) -> None:
    """A child that writes 3 MB before llama-server starts, under a 1 MiB cap: the log
    rotates (the current file and one predecessor, neither past the cap), whole lines
    only, and llama-server's own lines land in the current file. The whole output used
    to go into one file that grew for as long as the process ran (about 700 bytes for
    every pair llama-server scores)."""
    binary, _ = assets_or_fail()
    line = "x" * 99
    wrapper = _wrapper(tmp_path, binary, f'yes {line} | head -n 30000\nexec "{binary}" "$@"\n')
    cap = 1024 * 1024
    async with _started(wrapper, tmp_path, log_max_bytes=cap) as managed:
        async with httpx.AsyncClient(timeout=5) as http:
            assert (await http.get(managed.url + "/health")).status_code == 200
        port = managed.port
    _assert_capped(tmp_path, cap, line, port)


def _assert_capped(tmp_path: Path, cap: int, line: str, port: int) -> None:
    current = tmp_path / "llama-server.log"
    previous = tmp_path / "llama-server.log.1"
    assert sorted(p.name for p in tmp_path.glob("llama-server.log*")) == [
        current.name,
        previous.name,
    ]
    most = cap + len(line) + 1  # a file ends after the line it reached the cap in
    assert 0 < current.stat().st_size <= most and 0 < previous.stat().st_size <= most
    text = current.read_text(errors="replace")
    assert f"listening on http://127.0.0.1:{port}" in text  # llama-server's own line
    assert "cleaning up before exit" in text  # its last, in before stop() returned
    for written in (previous.read_text(), text):  # cut between lines, never inside one
        assert all(ln == line for ln in written.splitlines() if ln.startswith("x"))
