"""Managed mode: start, supervise and stop a local llama-server.

What is restarted and when: docs/reliability.md, "What dies, or hangs, is restarted".
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import threading
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import httpx
import structlog

from ..errors import StartError
from ..observability.instruments import Adder
from ..settings import LlamaAmx
from . import amx, llama_build
from .child_process import (
    die_with_parent,
    free_port,
    group_gone,
    group_ours,
    port_taken,
    signal_group,
)
from .memory import MemoryEstimate
from .output_log import MAX_BYTES, CappedLog, output_pipe

log = structlog.get_logger(__name__)

BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 30.0
STABLE_AFTER_S = 60.0
STOP_TIMEOUT_S = 10.0
COPIER_JOIN_S = 2.0  # for the last of a stopped child's output to reach its log
LIVENESS_EVERY_S = 10.0  # how often a running llama-server's /health is asked, and
LIVENESS_TIMEOUT_S = 5.0  # how long each ask waits;
UNRESPONSIVE_AFTER_S = 60.0  # unanswered this long (never 200), it is killed and restarted
HELP_TIMEOUT_S = 10.0  # for `llama-server --help`, read once to learn the flags it knows

# llama-server keeps prompts it has processed in host memory (`--cache-ram`, 8 GiB by
# default) and, each time a task starts, saves every idle slot there. Reranking sends a
# new prompt for every pair, so for us that memory only grows past the pod's limit in
# deploy/, and the saving gets slower as the cache grows (docs/decisions.md,
# "llama-server runs with `--cache-ram 0`"). Without it, each slot still reuses the prefix of its
# previous prompt (`cache_prompt`), which is the reuse a rerank request has
# (docs/backends.md, "llama-server's prompt cache in memory").
RAM_CACHE_OFF = ("--cache-ram", "0")


async def knows_flag(binary: Path, flag: str) -> bool:
    """Whether `binary --help` lists `flag`. False if it cannot tell in time; then, or if
    we are cancelled meanwhile, what it started is killed (a wrapper script's children
    too: it runs in a session of its own)."""
    try:
        proc = await asyncio.create_subprocess_exec(
            str(binary),
            "--help",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
    except OSError:
        return False  # its launch will say why, in the ordinary way
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), HELP_TIMEOUT_S)
    except BaseException as exc:  # timed out, or cancelled: nothing it started stays
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # its session, a wrapper's children too
        if proc.returncode is None:
            await asyncio.shield(proc.wait())
        if not isinstance(exc, TimeoutError):
            raise
        log.warning("llama_server_help_unanswered", waited_s=HELP_TIMEOUT_S, flag=flag)
        return False
    # Each option's line starts with its names (`-cram, --cache-ram N`, or padded:
    # `-c,    --ctx-size N`), then its argument and description: the names are the
    # leading words that start with a dash.
    for line in out.decode(errors="replace").splitlines():
        for word in re.split(r"[,\s]+", line.strip()):
            if not word.startswith("-"):
                break
            if word == flag:
                return True
    return False


# Loaded here, once: loading a library in the child, between fork and exec, can deadlock
# on a lock another of our threads held at the fork.
class ManagedLlamaServer:
    """One supervised llama-server process, restarted with back-off until `stop()`.

    Its loopback port stays the same across restarts, so the scorer's URL never changes.
    """

    def __init__(
        self,
        binary: Path,
        model: Path,
        *,
        slots: int,
        ctx_per_slot: int,
        extra_args: Sequence[str] = (),
        log_path: Path | None = None,
        ready_timeout_s: float = 120.0,
        restart_counter: Adder | None = None,
        liveness_every_s: float = LIVENESS_EVERY_S,
        unresponsive_after_s: float = UNRESPONSIVE_AFTER_S,
        log_max_bytes: int = MAX_BYTES,
        amx_mode: LlamaAmx = LlamaAmx.AUTO,
        amx_free_build: bool = False,
    ) -> None:
        self.binary = binary
        self.model = model
        self.identity = ""  # the model file's sha256, for the score cache (start.py)
        self.memory: MemoryEstimate | None = None  # said before it starts (start.py)
        self.port = free_port()
        self.slots = slots
        self.ctx_per_slot = ctx_per_slot
        self.extra_args = list(extra_args)
        self.log_path = log_path
        # Its output, capped in size (`output_log`); copied by a thread per launch.
        self._log = CappedLog(log_path, log_max_bytes) if log_path else None
        self._copiers: list[threading.Thread] = []
        self.ready_timeout_s = ready_timeout_s
        self.liveness_every_s = liveness_every_s
        self.unresponsive_after_s = unresponsive_after_s
        self.restarts = 0
        self._restart_counter = restart_counter  # `rerank.llama_server.restarts`
        if restart_counter is not None:
            restart_counter.add(0)  # shown from the start, so `increase()` sees the first
        self._proc: asyncio.subprocess.Process | None = None
        self._supervisor: asyncio.Task[None] | None = None
        self._stopping = False
        self._ram_cache_off = False  # learned in start(): whether to pass RAM_CACHE_OFF
        self._amx = amx.decide(
            amx_mode, amx_free_build=amx_free_build, args=self.extra_args, environ=os.environ
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc and self._proc.returncode is None else None

    def command(self) -> list[str]:
        ram_cache = list(RAM_CACHE_OFF) if self._ram_cache_off else []
        return [
            str(self.binary),
            "-m",
            str(self.model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "-np",
            str(self.slots),
            "-c",
            str(self.slots * self.ctx_per_slot),
            "--no-webui",
            *ram_cache,
            *self.extra_args,
        ]

    async def start(self) -> None:
        """Launch and wait until /health answers 200; raises StartError if it never does."""
        # The operator's own setting wins (an argument, or llama-server's variable for
        # it); a build older than the flag would refuse it.
        own = "LLAMA_ARG_CACHE_RAM" in os.environ or any(
            a in ("--cache-ram", "-cram") or a.startswith(("--cache-ram=", "-cram="))
            for a in self.extra_args
        )
        self._ram_cache_off = not own and await knows_flag(self.binary, RAM_CACHE_OFF[0])
        log.info(
            "llama_server_ram_cache",
            off=self._ram_cache_off,
            reason="operator's setting"
            if own
            else "passed --cache-ram 0"
            if self._ram_cache_off
            else "binary lacks the flag",
        )
        log.info("llama_server_amx", repack_off=self._amx.safe, reason=self._amx.reason)
        ready = await self._launch_ready()
        fell_back = not ready and self._fell_back(self._returncode())
        if fell_back:
            ready = await self._launch_ready()
        if not ready:
            code, safe = self._returncode(), _safe_setting()
            setting = (
                f", also with {safe}" if fell_back else f" (with {safe})" if self._amx.safe else ""
            )
            await self.stop()
            raise StartError(
                f"llama-server {_start_failure(code, self.ready_timeout_s)}"
                f"{setting}; {_see(self.log_path)}"
            )
        self._supervisor = asyncio.create_task(self._supervise())
        self._supervisor.add_done_callback(_report_end)

    async def _launch_ready(self) -> bool:
        """Launch, and whether it became ready in time."""
        try:
            await self._launch()
        except OSError as exc:
            raise StartError(f"cannot start llama-server {self.binary}: {exc}") from None
        return await self.wait_ready(self.ready_timeout_s)

    def _returncode(self) -> int | None:
        return self._proc.returncode if self._proc else None

    def _fell_back(self, code: int | None) -> bool:
        """Whether a child's end by a CPU or memory fault turned the safe setting on for
        the launches to come (`auto` mode, once: the setting is then kept)."""
        if not self._amx.fall_back or code is None or -code not in amx.FAULT_SIGNALS:
            return False
        self._amx = amx.Decision(True, False, f"llama-server {llama_build.how_it_ended(code)}")
        log.warning(
            "llama_server_repack_off",
            reason=self._amx.reason,
            setting=_safe_setting(),
            docs="docs/backends.md, CPUs with AMX",
        )
        return True

    async def _launch(self) -> None:
        stdout = None
        if self._log is not None:
            self._copiers = [c for c in self._copiers if c.is_alive()]
            stdout, copier = output_pipe(self._log)
            self._copiers.append(copier)
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *self.command(),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL if stdout is None else stdout,
                stderr=asyncio.subprocess.STDOUT,
                env=self._amx.env(os.environ),
                start_new_session=True,
                preexec_fn=partial(die_with_parent, os.getpid()),
            )
        finally:
            if stdout is not None:
                os.close(stdout)  # the child holds it now: the copier ends when it exits
        # Where its output went: named after this process, so not findable by `pid`.
        where = {"log": str(self.log_path)} if self.log_path else {}
        log.info(
            "llama_server_started",
            pid=self._proc.pid,
            port=self.port,
            model=self.model.name,
            slots=self.slots,
            restarts=self.restarts,
            **where,
        )

    async def wait_ready(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=2.0, trust_env=False) as client:
            while time.monotonic() < deadline:
                if self._proc is None or self._proc.returncode is not None:
                    return False
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(self.url + "/health")).status_code == 200:
                        return True
                await asyncio.sleep(0.2)
        return False

    async def _supervise(self) -> None:
        backoff = BACKOFF_START_S
        running = True  # start() launched it
        while not self._stopping:
            if running:
                started = time.monotonic()
                code = await self._until_exit()
                if self._stopping:
                    return
                if time.monotonic() - started > STABLE_AFTER_S:
                    backoff = BACKOFF_START_S
                log.warning("llama_server_exited", exit_code=code, restart_in_s=backoff)
                self._fell_back(code)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX_S)
            if self._stopping:
                return
            self.restarts += 1
            if self._restart_counter is not None:
                self._restart_counter.add(1)
            running = await self._restart(backoff)

    async def _restart(self, backoff_s: float) -> bool:
        """Launch again and wait for it to be ready: whether a child was launched (and so
        is to be waited on); one never ready is killed. `backoff_s`: the wait before the
        next try, should this one not launch."""
        if port_taken(self.port):
            # Launched, it would fail to bind while the other program's /health answered
            # ours: taken for ready, and scored by whatever that program is.
            log.error("llama_server_port_taken", port=self.port, retry_in_s=backoff_s)
            return False
        try:
            await self._launch()
        except OSError as exc:
            log.error(
                "llama_server_launch_failed",
                binary=str(self.binary),
                error=f"{type(exc).__name__}: {exc}",
                retry_in_s=backoff_s,
            )
            return False
        assert self._proc is not None
        if await self.wait_ready(self.ready_timeout_s):
            log.info("llama_server_ready", pid=self.pid, restarts=self.restarts)
        elif self._proc.returncode is None:
            # Alive but never healthy (stuck loading, say): as good as dead, and it
            # would otherwise stay so, since only an exit brought a restart.
            log.warning("llama_server_not_ready", pid=self._proc.pid, waited_s=self.ready_timeout_s)
            await self._kill()
        return True

    async def _until_exit(self) -> int:
        """Wait for the running child to exit: its exit code. One whose `/health` has not
        answered 200 for `unresponsive_after_s` is killed first."""
        assert self._proc is not None
        proc, answered = self._proc, time.monotonic()
        # One waiter for the whole run: a `wait()` cancelled every poll would leave its
        # future in the transport's list of exit waiters until the process exits.
        exited = asyncio.ensure_future(proc.wait())
        async with contextlib.AsyncExitStack() as cleanup:
            cleanup.callback(exited.cancel)
            client = await cleanup.enter_async_context(
                httpx.AsyncClient(timeout=LIVENESS_TIMEOUT_S, trust_env=False)
            )
            while True:
                if (await asyncio.wait({exited}, timeout=self.liveness_every_s))[0]:
                    return exited.result()
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(self.url + "/health")).status_code == 200:
                        answered = time.monotonic()
                        continue
                silent = time.monotonic() - answered
                if silent >= self.unresponsive_after_s and proc.returncode is None:
                    log.warning(
                        "llama_server_unresponsive", pid=proc.pid, silent_s=round(silent, 1)
                    )
                    await self._kill()

    async def _kill(self) -> None:
        assert self._proc is not None
        signal_group(self._proc.pid, signal.SIGKILL)
        await group_gone(self._proc, STOP_TIMEOUT_S)

    async def stop(self) -> None:
        """Stop supervising, then SIGTERM the child (SIGKILL after STOP_TIMEOUT_S); its
        last output is copied into the log before this returns."""
        try:
            await self._stop()
        finally:
            await asyncio.to_thread(self._close_log)

    def _close_log(self) -> None:
        for copier in self._copiers:
            copier.join(COPIER_JOIN_S)  # one a stray grandchild keeps open is left
        if self._log is not None:
            self._log.close()

    async def _stop(self) -> None:
        self._stopping = True
        if self._supervisor is not None:
            self._supervisor.cancel()
            await asyncio.gather(self._supervisor, return_exceptions=True)
        proc = self._proc
        # Its group even once it has exited: a wrapper's llama-server may be left.
        if proc is None or not group_ours(proc) or not signal_group(proc.pid, signal.SIGTERM):
            return
        if not await group_gone(proc, STOP_TIMEOUT_S) and group_ours(proc):
            signal_group(proc.pid, signal.SIGKILL)
            await group_gone(proc, STOP_TIMEOUT_S)
        log.info("llama_server_stopped", exit_code=proc.returncode)


def _report_end(task: asyncio.Task[None]) -> None:
    """The supervisor ends only by `stop()`: anything else would leave the backend down
    for good without a word, so it is logged."""
    if not task.cancelled() and task.exception() is not None:
        log.error("llama_server_supervisor_failed", error=repr(task.exception()))


def _safe_setting() -> str:
    return " ".join(f"{k}={v}" for k, v in amx.SAFE_ENV.items())


def _start_failure(code: int | None, timeout_s: float) -> str:
    if code is None:
        return f"did not become ready within {timeout_s:.0f} s"
    return f"{llama_build.how_it_ended(code)} while starting"


def _see(log_path: Path | None) -> str:
    """Where its output is; a log file named but never written (a child that dies
    silently: its copier opens the file on the first byte) does not exist."""
    if log_path is None:
        return "its output was not kept"
    if not log_path.exists():
        return f"it wrote nothing (no {log_path})"
    return f"see {log_path}"


# Why a reranker GGUF is scored by `completion` unless told otherwise: measured with the
# Qwen3-Reranker-0.6B speed twin on the development CPU (docs/backends.md).
