"""The installed commands as a user runs them: `rerank-server` under SIGTERM, `rerank-client`."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from rerank_client import AsyncRerankClient
from rerank_client.cli import main as client_main

from rerank_server.managed.child_process import free_port
from rerank_server.server import RunningServer
from tests.fakes.llama import FakeLlamaServer
from tests.server_process import wait_listening


async def test_sigterm_drains_in_flight_call_and_exits_zero(fake_llama: FakeLlamaServer) -> None:
    fake_llama.latency_s = 0.8
    port = free_port()
    env = {
        **os.environ,
        "RERANK_PORT": str(port),
        "RERANK_BACKEND_URL": fake_llama.url,
        "RERANK_HTTP_PORT": "0",
        "RERANK_PROBE": "0",
        "RERANK_GRACE_PERIOD_S": "5",
        "RERANK_LOG_FORMAT": "json",
        "RERANK_METRICS_PORT": "0",
    }
    # Popen returns at once; the test awaits everything that waits on the process.
    proc = subprocess.Popen(  # noqa: ASYNC220
        [sys.executable, "-m", "rerank_server"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        await wait_listening(port, proc)
        async with AsyncRerankClient(f"127.0.0.1:{port}") as client:
            call = asyncio.create_task(client.rerank("q", ["a", "b", "c"]))
            await asyncio.sleep(0.3)  # the call is now waiting on the backend
            proc.send_signal(signal.SIGTERM)
            answer = await call
        assert answer.reranked, "in-flight call was not allowed to finish"
        assert await asyncio.to_thread(proc.wait, 15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.stdout is not None
    with proc.stdout:
        output = proc.stdout.read().decode()
    events = [json.loads(line)["event"] for line in output.splitlines() if line.startswith("{")]
    assert events.index("shutting_down") < events.index("stopped")


async def test_healthcheck_command_exits_zero_when_serving_and_one_when_not(
    server: RunningServer,
) -> None:
    """What the container HEALTHCHECK runs: reads RERANK_PORT like the server."""

    def healthcheck(port: int) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "rerank_server", "healthcheck"],
            capture_output=True,
            text=True,
            env={**os.environ, "RERANK_HOST": "0.0.0.0", "RERANK_PORT": str(port)},
        )

    ok = await asyncio.to_thread(healthcheck, server.port)
    assert ok.returncode == 0 and ok.stdout.strip() == "SERVING"
    await server.edge.health.enter_graceful_shutdown()
    draining = await asyncio.to_thread(healthcheck, server.port)
    assert draining.returncode == 1 and "NOT_SERVING" in draining.stderr
    nobody = await asyncio.to_thread(healthcheck, free_port())
    assert nobody.returncode == 1 and "UNAVAILABLE" in nobody.stderr


def test_rerank_server_help_lists_settings_and_subcommands() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "rerank_server", "--help"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert "--backend-url" in out and "RERANK_BACKEND_URL" in out and "--managed" in out
    for name in ("prepare", "healthcheck", "eval", "bench"):
        assert any(
            line.split()[:1] == [name] and len(line.split()) > 3 for line in out.splitlines()
        ), f"{name} has no line of its own in --help"


@pytest.mark.parametrize(
    ("variable", "flag"),
    [
        ("RERANK_PORT", "--port / RERANK_PORT"),
        ("RERANK_METRICS_PORT", "--metrics-port / RERANK_METRICS_PORT"),
    ],
)
def test_port_in_use_exits_2_with_one_line_naming_the_flag(
    fake_llama: FakeLlamaServer, variable: str, flag: str
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {
            **os.environ,
            "RERANK_PORT": str(free_port()),
            "RERANK_METRICS_PORT": "0",
            "RERANK_HTTP_PORT": "0",
            "RERANK_BACKEND_URL": fake_llama.url,
            "RERANK_PROBE": "0",
            variable: str(port),
        }
        proc = subprocess.run(
            [sys.executable, "-m", "rerank_server"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0] and f"127.0.0.1:{port}" in lines[0]


def _tool_without(command: str, modules: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    """`rerank-server COMMAND --help` as if `modules` were not installed."""
    hide = f"import sys; [sys.modules.__setitem__(m, None) for m in {modules!r}]; "
    run = f"from rerank_server.cli import main; sys.exit(main([{command!r}, '--help']))"
    return subprocess.run([sys.executable, "-c", hide + run], capture_output=True, text=True)


@pytest.mark.parametrize(("command", "extra"), [("eval", "eval"), ("bench", "bench")])
def test_tool_without_its_extra_names_the_extra_in_one_line(command: str, extra: str) -> None:
    proc = _tool_without(command, ("ranx", "matplotlib"))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"pip install 'rerank-server[{extra}]'" in lines[0]


def test_bench_needs_none_of_the_evaluation_libraries() -> None:
    """A GPU machine measuring its backend has no BM25 or ranking metrics to install."""
    proc = _tool_without("bench", ("bm25s", "Stemmer", "ranx", "tqdm", "scipy"))
    assert proc.returncode == 0, proc.stderr
    assert "--backend-url" in proc.stdout


def test_bad_setting_exits_2_with_message() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "rerank_server"],
        capture_output=True,
        text=True,
        env={**os.environ, "RERANK_CONCURRENCY": "0"},
    )
    assert proc.returncode == 2
    assert "--concurrency / RERANK_CONCURRENCY" in proc.stderr


def test_a_managed_llama_server_that_cannot_start_is_one_line_and_exit_1(
    tmp_path: pytest.TempPathFactory,
) -> None:
    """Managed mode's start failures (a binary that is not there, a child that exits at
    once) used to end in a traceback."""
    crashing = tmp_path / "llama-server"  # type: ignore[operator]
    crashing.write_text("#!/bin/sh\nexit 7\n")
    crashing.chmod(0o755)
    # A child that dies silently, as a native build on an older CPU does (SIGILL): the
    # message said "exited with code -4" and named a log file that was never created.
    signalled = tmp_path / "llama-server-signalled"  # type: ignore[operator]
    signalled.write_text("#!/bin/sh\nkill -SEGV $$\n")
    signalled.chmod(0o755)
    # (Launched a second time with LLAMA_ARG_REPACK=0, or the first on a CPU with AMX:
    # tests/real/test_amx_fallback.py.)
    for binary, message in (
        ("/nonexistent/llama-server", "not an executable file"),
        (str(crashing), "llama-server exited with code 7 while starting"),
        (str(signalled), "llama-server was killed by SIGSEGV while starting"),
        (str(signalled), "LLAMA_ARG_REPACK=0; it wrote nothing (no "),
    ):
        proc = subprocess.run(
            # Any file as the model: nothing is downloaded, and nothing reads it.
            [
                sys.executable,
                "-m",
                "rerank_server",
                "--managed",
                "--llama-server",
                binary,
                "--model-path",
                str(crashing),
                "--port",
                str(free_port()),
                "--http-port",
                "0",
                "--metrics-port",
                "0",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "RERANK_CACHE_DIR": str(tmp_path)},
        )
        assert proc.returncode == 1, proc.stderr
        assert "Traceback" not in proc.stderr
        assert "rerank-server: error: " in proc.stderr and message in proc.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tls-cert", "c.pem", "--tls-key", "k.pem", "q", "d"], "need tls_ca"),
        (["--tls-ca", "/nonexistent/ca.pem", "q", "d"], "/nonexistent/ca.pem"),
        (["--file", "/nonexistent/c.jsonl", "q"], "--file /nonexistent/c.jsonl"),
        (["q"], "no documents"),
        (["--top-k", "-1", "q", "d"], "top_k must be a whole number"),
    ],
)
def test_rerank_client_cli_command_line_mistakes_are_one_line(
    argv: list[str], message: str
) -> None:
    """Found while building the call, not by the server: one line, exit 1, no
    traceback (a ValueError, a FileNotFoundError used to escape)."""
    proc = subprocess.run(
        [sys.executable, "-m", "rerank_client.cli", "--target", f"127.0.0.1:{free_port()}", *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert proc.stderr.startswith("rerank-client: ") and "Traceback" not in proc.stderr
    assert message in proc.stderr


async def test_rerank_client_cli_prints_ranked_table(
    server: RunningServer, fake_llama: FakeLlamaServer, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_llama.scores = {"meat": 0.9, "stock": 0.05}
    argv = [
        "--target",
        f"127.0.0.1:{server.port}",
        "--blend",
        "rerank_only",
        "what do cats eat?",
        "The stock market fell.",
        "Cats eat meat.",
        "Kittens nap.",
    ]
    assert await asyncio.to_thread(client_main, argv) == 0
    # The in-process server logs JSON to the same stdout; the table starts at its header.
    out = capsys.readouterr().out.splitlines()
    lines = out[next(i for i, line in enumerate(out) if line.split()[:2] == ["rank", "id"]) :]
    assert lines[1].split()[:2] == ["1", "1"] and "Cats eat meat." in lines[1]
    assert lines[-1].startswith("reranked by chat")


async def test_rerank_client_cli_json_from_file(
    server: RunningServer, tmp_path: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "c.jsonl"  # type: ignore[operator]
    path.write_text('{"id": "x", "text": "one"}\n"two"\n{"id": "z", "text": "three"}\n')
    argv = ["--target", f"127.0.0.1:{server.port}", "--json", "--file", str(path), "q"]
    assert await asyncio.to_thread(client_main, argv) == 0
    out = capsys.readouterr().out
    data = json.loads(out[out.index("{\n") :])
    assert sorted(r["id"] for r in data["results"]) == ["1", "x", "z"]
    assert data["summary"]["reranked"] is True


async def test_rerank_client_cli_reports_invalid_request(
    server: RunningServer, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--target", f"127.0.0.1:{server.port}", " ", "doc"]
    assert await asyncio.to_thread(client_main, argv) == 1
    assert "INVALID_ARGUMENT: query: must not be empty" in capsys.readouterr().err


def test_ctrl_c_while_a_managed_llama_server_starts_is_one_line_and_stops_it(
    tmp_path: pytest.TempPathFactory,
) -> None:
    """Ctrl-C while llama-server loads (before the server's own signal handlers are in
    place) printed a 36-line KeyboardInterrupt traceback."""
    pid_file = tmp_path / "child.pid"  # type: ignore[operator]
    loading = tmp_path / "llama-server"  # type: ignore[operator]
    # It answers `--help` at once (the flag probe) and, run as the server, never gets
    # ready; the pid is written whole (`mv`) so that it is never read half-written.
    loading.write_text(
        '#!/bin/sh\n[ "$1" = --help ] && exit 0\n'
        f"echo $$ > {pid_file}.tmp && mv {pid_file}.tmp {pid_file}\n"
        "exec sleep 60\n"
    )
    loading.chmod(0o755)
    with subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rerank_server",
            "--managed",
            "--llama-server",
            str(loading),
            "--model-path",
            str(loading),
            "--port",
            str(free_port()),
            "--http-port",
            "0",
            "--metrics-port",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "RERANK_CACHE_DIR": str(tmp_path)},
        # As from a terminal: a test run started in the background (CI, `make test &`)
        # has SIGINT ignored, which the server would inherit and keep until it
        # installs its own handlers, once it serves.
        preexec_fn=_sigint_default,
    ) as proc:
        try:
            deadline = time.monotonic() + 30
            while not pid_file.exists():
                assert time.monotonic() < deadline, "the stand-in llama-server never started"
                time.sleep(0.05)
            child = int(pid_file.read_text())
            proc.send_signal(signal.SIGINT)
            _, stderr = proc.communicate(timeout=30)
        finally:
            proc.kill()  # (nothing, once it has exited) and its pipes closed on leaving
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and stderr.strip().endswith("rerank-server: interrupted")
    with pytest.raises(ProcessLookupError):
        for _ in range(100):  # the child is stopped, not left behind
            os.kill(child, 0)
            time.sleep(0.05)


def test_a_taken_port_is_found_before_a_managed_llama_server_starts(
    tmp_path: pytest.TempPathFactory,
) -> None:
    """The ports were first bound after llama-server had loaded (minutes the first
    time), and `--metrics-port` equal to `--port` was reported as another program
    holding `--port`."""
    started = tmp_path / "started"  # type: ignore[operator]
    loading = tmp_path / "llama-server"  # type: ignore[operator]
    loading.write_text(f"#!/bin/sh\ntouch {started}\nexec sleep 60\n")
    loading.chmod(0o755)
    base = [
        sys.executable,
        "-m",
        "rerank_server",
        "--managed",
        "--llama-server",
        str(loading),
        "--model-path",
        str(loading),
        "--llama-ready-timeout-s",
        "30",
    ]
    env = {**os.environ, "RERANK_CACHE_DIR": str(tmp_path)}
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        for ports, setting in (
            ([taken, free_port()], "--port / RERANK_PORT"),
            ([free_port(), taken], "--http-port / RERANK_HTTP_PORT"),
        ):
            proc = subprocess.run(
                [
                    *base,
                    "--port",
                    str(ports[0]),
                    "--http-port",
                    str(ports[1]),
                    "--metrics-port",
                    "0",
                ],
                capture_output=True,
                text=True,
                timeout=60,
                env=env,
            )
            assert proc.returncode == 2, proc.stderr
            assert f"({setting})" in proc.stderr and "Traceback" not in proc.stderr
    assert not started.exists(), "llama-server was started first"
    port = free_port()
    proc = subprocess.run(
        [*base, "--port", str(port), "--metrics-port", str(port)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 2
    assert "--metrics-port / RERANK_METRICS_PORT: must differ from --port" in proc.stderr


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
