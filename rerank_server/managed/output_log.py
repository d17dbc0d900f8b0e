"""Where a managed llama-server's output goes: a log file capped in size, and a cap on how
many such files a cache directory keeps (docs/configuration.md, "Managed mode").
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from pathlib import Path
from typing import BinaryIO

MAX_BYTES = 16 * 1024 * 1024  # a file; with its predecessor at most twice this
KEEP_FILES = 8  # logs of earlier runs kept in a directory, newest first
PIPE_BYTES = 1024 * 1024  # room for a second or more of output while the copier waits
READ_BYTES = 64 * 1024


class CappedLog:
    """Appends to `path`; past `max_bytes` the file becomes `path.1` (replacing the one
    before) and a new one begins, between lines: a file can pass the cap by the line it
    ends inside of, up to twice the cap (output without line ends is cut there)."""

    def __init__(self, path: Path, max_bytes: int = MAX_BYTES) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self._lock = threading.Lock()  # copiers of a restarted child's output overlap
        self._file: BinaryIO | None = None
        self._size = 0
        self._line_open = False  # the file ends inside a line

    def write(self, data: bytes) -> None:
        if not data:
            return
        with self._lock:
            file = self._open()
            cut = self._cut(data)
            if cut is not None:
                file.write(data[:cut])
                file = self._rotate()
                data = data[cut:]
            if data:
                file.write(data)
                self._size += len(data)
                self._line_open = not data.endswith(b"\n")
            file.flush()

    def _cut(self, data: bytes) -> int | None:
        """Where `data` ends this file (None: it does not): after the last line that fits;
        else after the line the file ends inside of (a file may pass the cap by it); else,
        when the file ends at a line's end, before `data`. A line never ends within twice
        the cap is cut there."""
        room = self.max_bytes - self._size
        if len(data) <= room or self._size == 0:
            return None
        if last := data.rfind(b"\n", 0, max(room, 0)) + 1:
            return last
        if not self._line_open:
            return 0
        hard = max(2 * self.max_bytes - self._size, 0)
        first = data.find(b"\n") + 1
        if first and first <= hard:
            return first
        return hard if len(data) > hard else None

    def _open(self) -> BinaryIO:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)  # removed meanwhile?
            self._file = self.path.open("ab")
            self._size = self._file.tell()
        return self._file

    def _rotate(self) -> BinaryIO:
        assert self._file is not None
        self._file.close()
        self._file, self._size = None, 0
        with contextlib.suppress(FileNotFoundError):  # removed meanwhile (`prune`, a person)
            os.replace(self.path, self.path.with_name(self.path.name + ".1"))
        return self._open()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def output_pipe(log: CappedLog) -> tuple[int, threading.Thread]:
    """A pipe for a child's stdout and stderr, and the started thread that copies what
    comes through it into `log` until every writer has closed it. The caller passes the
    write end to the child and closes it then."""
    read_end, write_end = os.pipe()
    with contextlib.suppress(OSError):  # a smaller pipe still works
        fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    copier = threading.Thread(
        target=_copy, args=(read_end, log), daemon=True, name="llama-server-output"
    )
    copier.start()
    return write_end, copier


def _copy(read_end: int, log: CappedLog) -> None:
    try:
        while chunk := os.read(read_end, READ_BYTES):
            with contextlib.suppress(OSError):  # a full disk loses log lines, not scoring
                log.write(chunk)
    finally:
        os.close(read_end)


def prune(directory: Path, pattern: str, keep: int = KEEP_FILES) -> list[Path]:
    """Removes all but the newest `keep` logs matching `pattern` (by modification time),
    each with its predecessor; returns what was removed."""
    logs = sorted(directory.glob(pattern), key=_mtime, reverse=True)
    removed = []
    for path in logs[keep:]:
        for old in (path, path.with_name(path.name + ".1")):
            with contextlib.suppress(FileNotFoundError):
                old.unlink()
                removed.append(old)
    return removed


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0
