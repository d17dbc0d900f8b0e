"""The llama-server child's process: its port, its process group, its parent's death."""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import socket
import sys
import time
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_taken(port: int) -> bool:
    """Whether something listens on our loopback `port` now: a connection is taken. (A
    trial bind would also count the connections of the server just killed, in TIME_WAIT,
    or not, depending on how that server bound.) Unknown, say out of file descriptors:
    not taken, and the launch finds out."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False


def signal_group(pgid: int, sig: int) -> bool:
    """`sig` to the child's process group (it leads its own session, so the group's id
    is its pid), so that what a wrapper script started goes too: whether any of the
    group was there. Linux gives no new process that id while one of the group lives."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member that changed its user: there all the same
        return True
    return True


def group_ours(proc: asyncio.subprocess.Process) -> bool:
    """Whether the group named by the child's pid is still the child's: while it runs,
    or once it is reaped and no process has taken its pid (one that has may lead a new
    group of that id; while any member of ours lives, Linux gives the pid to none)."""
    if proc.returncode is None:
        return True
    try:
        os.kill(proc.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def group_running(pgid: int) -> bool:
    """Whether a process of the group, other than its reaped leader, still runs. Zombies
    do not count: where nothing reaps orphans (a container whose first process is ours,
    without an init), a wrapper's llama-server stays one after it has exited."""
    if not Path("/proc/self/stat").exists():
        return signal_group(pgid, 0)  # signal 0: only whether any is there
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # gone meanwhile
            continue
        # pid (comm) state ppid pgrp ...: the name may hold spaces and parentheses
        state, _ppid, pgrp = text[text.rindex(")") + 2 :].split()[:3]
        if int(pgrp) == pgid and state != "Z" and stat.parent.name != str(pgid):
            return True
    return False


async def group_gone(proc: asyncio.subprocess.Process, timeout_s: float) -> bool:
    """Wait until the child has exited and nothing of its group is left (a wrapper's
    llama-server outlives the wrapper by its own shutdown): whether that happened within
    `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    try:
        await asyncio.wait_for(proc.wait(), timeout_s)
    except TimeoutError:
        return False
    while group_ours(proc) and group_running(proc.pid):
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.05)
    return True


_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def die_with_parent(parent: int) -> None:  # runs in the child between fork and exec
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the line above: no signal
            os._exit(1)
