"""Managed mode on a CPU whose AMX kernels crash llama.cpp (docs/backends.md, "CPUs with
AMX"), stood in for by a `llama-server` script that dies by SIGSEGV while loading unless
started with the safe setting, and otherwise runs the real llama-server.

The script stands where the cache keeps its build without AMX kernels, so `--llama-amx
auto` trusts it from the start and must fall back on its own, whatever this machine's CPU
reports: the same path a hypervisor that hides `amx_tile` would take."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import structlog

from rerank_server import settings
from rerank_server.managed import converted, llama_build
from rerank_server.managed.child_process import free_port
from rerank_server.managed.llama_server import ManagedLlamaServer
from tests.conftest import client_of
from tests.real.conftest import assets_or_fail, healthy
from tests.server_process import supervised
from tests.waiting import eventually

CRASH_UNLESS_SAFE = """
case " $* " in *" --no-repack "*) LLAMA_ARG_REPACK=0 ;; esac
if [ "${LLAMA_ARG_REPACK-}" = 0 ]; then exec "$REAL" "$@"; fi
kill -SEGV $$
"""
ALWAYS_CRASH = "kill -SEGV $$\n"
BAD_MODEL = 'echo "error: failed to load model" >&2; exit 1\n'
RUNS = 'exec "$REAL" "$@"\n'


def _stand_in(cache: Path, body: str) -> Path:
    """A `llama-server` at the cache's AMX-free build path that writes each launch's
    LLAMA_ARG_REPACK to `launches` beside it, then runs `body` ($REAL: the real binary)."""
    binary, _ = assets_or_fail()
    script = llama_build.cached_llama_server(cache)
    script.parent.mkdir(parents=True)
    script.write_text(
        "#!/bin/sh\n"
        f'REAL="{binary}"\n'
        'if [ "$1" = --help ]; then exec "$REAL" --help; fi\n'  # not a launch
        f'echo "${{LLAMA_ARG_REPACK-unset}}" >> "{script.parent}/launches"\n' + body
    )
    script.chmod(0o755)
    assert llama_build.is_amx_free_build(script, cache)
    return script


def _launches(script: Path) -> list[str]:
    path = script.parent / "launches"
    return path.read_text().split() if path.exists() else []


def _env(cache: Path, script: Path, *extra: str) -> dict[str, str]:
    """The server's environment: `cache` holds the default model (MiniLM-L6) where `make
    run` finds it, and `script` is the llama-server to run."""
    model = converted.embedding_model_path(settings.load([]).cache_dir)
    (cache / "models").mkdir(exist_ok=True)
    (cache / "models" / model.name).symlink_to(model)
    env = {
        **os.environ,
        "RERANK_CACHE_DIR": str(cache),
        "RERANK_LLAMA_SERVER": str(script),
        "RERANK_LOG_FORMAT": "json",
    }
    env.pop("LLAMA_ARG_REPACK", None)
    env.pop("RERANK_LLAMA_AMX", None)
    env.update(kv.split("=", 1) for kv in extra)
    return env


def _start_fails(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`rerank-server --managed` that cannot start: exit 1, one line, no traceback."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rerank_server",
            "--managed",
            "--port",
            str(free_port()),
            "--http-port",
            "0",
            "--metrics-port",
            "0",
            "--no-probe",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    return proc


async def test_a_llama_server_killed_while_loading_comes_up_with_repacking_off(
    tmp_path: Path,
) -> None:
    """Killed by SIGSEGV at its first launch, it is launched once more with
    LLAMA_ARG_REPACK=0, serves, and the log says why in one line; a later restart keeps
    the setting and says nothing more."""
    script = _stand_in(tmp_path, CRASH_UNLESS_SAFE)
    env = _env(tmp_path, script)
    async with supervised(
        None,
        workers=1,
        start_timeout_s=180,
        **{k: v for k, v in env.items() if k.startswith(("RERANK_", "LLAMA_"))},
    ) as server:
        assert _launches(script) == ["unset", "0"]
        [said] = server.logged("llama_server_repack_off")
        assert said["reason"] == "llama-server was killed by SIGSEGV"
        assert said["setting"] == "LLAMA_ARG_REPACK=0"
        async with client_of(server) as client:
            answer = await client.rerank(
                "what do cats eat?",
                ["Cats eat meat.", "The stock market fell.", "Kittens need milk."],
                always_score=True,
                timeout=60,
            )
        assert answer.reranked and answer.summary.scored == 3, answer.summary

        [child] = server.children(b"llama-server")
        os.kill(child, signal.SIGKILL)
        assert await eventually(lambda: len(_launches(script)) == 3, 30)
        assert await eventually(lambda: bool(server.logged("llama_server_ready")), 120)
        assert _launches(script) == ["unset", "0", "0"]
        assert len(server.logged("llama_server_repack_off")) == 1


def test_one_that_crashes_with_the_safe_setting_too_is_reported_after_two_launches(
    tmp_path: Path,
) -> None:
    """No loop: the second crash ends the start, and the message names both."""
    script = _stand_in(tmp_path, ALWAYS_CRASH)
    proc = _start_fails(_env(tmp_path, script))
    assert _launches(script) == ["unset", "0"]
    assert (
        "llama-server was killed by SIGSEGV while starting, also with "
        "LLAMA_ARG_REPACK=0; it wrote nothing"
    ) in proc.stderr


def test_a_crash_for_another_reason_is_reported_as_before(tmp_path: Path) -> None:
    """An exit with a code (a model that does not load) is not a CPU fault: one launch."""
    script = _stand_in(tmp_path, BAD_MODEL)
    proc = _start_fails(_env(tmp_path, script))
    assert _launches(script) == ["unset"]
    assert "llama-server exited with code 1 while starting; see " in proc.stderr
    assert "llama_server_repack_off" not in proc.stdout


@pytest.mark.parametrize(
    ("setting", "launch", "said"),
    [
        ("RERANK_LLAMA_AMX=on", "unset", ";"),  # the AMX path forced on: no fallback
        ("LLAMA_ARG_REPACK=1", "1", ";"),  # the operator's own setting wins
        ("RERANK_LLAMA_AMX=off", "0", " (with LLAMA_ARG_REPACK=0);"),  # safe from the start
    ],
)
def test_the_operator_can_force_the_amx_path_on_or_off(
    tmp_path: Path, setting: str, launch: str, said: str
) -> None:
    """One launch each, reported as it ended."""
    script = _stand_in(tmp_path, ALWAYS_CRASH)
    proc = _start_fails(_env(tmp_path, script, setting))
    assert _launches(script) == [launch]
    assert f"llama-server was killed by SIGSEGV while starting{said}" in proc.stderr


async def test_a_running_llama_server_killed_by_a_fault_restarts_with_repacking_off(
    tmp_path: Path,
) -> None:
    """A crash in the kernels at the first real request, not while loading: the restart
    gets the safe setting (and keeps it), the log says so once."""
    script = _stand_in(tmp_path, RUNS)
    _, model = assets_or_fail()
    managed = ManagedLlamaServer(
        script,
        model,
        slots=1,
        ctx_per_slot=512,
        log_path=tmp_path / "llama-server.log",
        amx_free_build=True,
    )
    await managed.start()
    try:
        first = managed.pid
        assert first is not None and _launches(script) == ["unset"]
        with structlog.testing.capture_logs() as logged:
            os.kill(first, signal.SIGSEGV)
            assert await eventually(lambda: _launches(script) == ["unset", "0"], 30)
            assert await eventually(lambda: healthy(managed, first), 120, poll_s=0.2)
        [said] = [e for e in logged if e["event"] == "llama_server_repack_off"]
        assert said["reason"] == "llama-server was killed by SIGSEGV"
    finally:
        await managed.stop()
