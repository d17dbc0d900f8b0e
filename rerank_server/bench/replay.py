"""The backend's own time for one request's calls: what rerank-server's latency is
measured against in the overhead scenario (docs/benchmarks.md, "Overhead").
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from types import TracebackType
from urllib.parse import urlsplit

import httpx


async def recorded_calls(http: httpx.AsyncClient, url: str) -> list[tuple[str, bytes]]:
    """(path, body) of the scoring calls the fake received since `start_recording`."""
    answer = (await http.get(url + "/bench/recorded")).raise_for_status().json()
    return [(call["path"], call["body"].encode()) for call in answer]


async def start_recording(http: httpx.AsyncClient, url: str) -> None:
    (await http.post(url + "/bench/record", content=b"{}")).raise_for_status()


def _raw(host: str, path: str, body: bytes) -> bytes:
    return (
        b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (path.encode(), host.encode(), len(body), body)
    )


class Replay:
    """`connections` kept-alive connections to the backend at `url`, replaying `calls`.

    The bodies go as prebuilt bytes and the answers are read unparsed: a client can
    hardly cost less, so the latency rerank-server adds, measured against this, is an
    upper bound.
    """

    def __init__(self, url: str, calls: Sequence[tuple[str, bytes]], connections: int) -> None:
        parts = urlsplit(url)
        self._host, self._port = parts.hostname or "127.0.0.1", parts.port or 80
        self._requests = [_raw(parts.netloc, path, body) for path, body in calls]
        self._size = max(1, min(connections, len(calls)))
        self._idle: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = (
            asyncio.Queue()
        )

    async def __aenter__(self) -> Replay:
        for _ in range(self._size):
            self._idle.put_nowait(await asyncio.open_connection(self._host, self._port))
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        while not self._idle.empty():
            _, writer = self._idle.get_nowait()
            writer.close()

    async def run(self) -> None:
        """Every call at once, as many in flight as there are connections."""
        await asyncio.gather(*(self._one(raw) for raw in self._requests))

    async def _one(self, raw: bytes) -> None:
        reader, writer = await self._idle.get()
        try:
            writer.write(raw)
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            if not lines[0].startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"the backend answered {lines[0]!r}")
            length = next(
                int(line.split(b":", 1)[1])
                for line in lines
                if line.lower().startswith(b"content-length:")
            )
            await reader.readexactly(length)
        finally:
            self._idle.put_nowait((reader, writer))
