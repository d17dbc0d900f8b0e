"""CPU per pair of two rerank-server versions, measured side by side.

Usage: python scripts/bench_ab.py OLD_TREE [--kinds chat,rerank] [--sizes 10,40,100]
                                  [--requests 200] [--block 25] [--instructions]
                                  [--cache]

Shared VMs change speed by 20-50% within an hour, so two `rerank-server bench` runs taken
apart cannot be compared. This starts both versions at once against one instant fake
backend (the working tree's) and alternates blocks of `--block` requests between them,
so each block pair sees the same machine. OLD_TREE is a checkout of the old version, e.g.
`git worktree add /tmp/old <rev>`; the new one is this checkout. CPU is read per thread
from `/proc/PID/task/*/schedstat` (nanoseconds, every thread of the server).

Absolute figures run higher than `rerank-server bench`'s: two servers take turns, so
each starts its blocks with cold caches. Compare the two columns, not across runs.

`--instructions` counts instead of timing: each version runs under valgrind's callgrind
(`apt-get install valgrind`), one after the other, and the instructions its process
executes over `--requests` requests (every thread, after a warm-up) are divided by them.
The machine's speed does not enter the count, so a change of a few percent that timing
cannot tell from noise shows; it says nothing of cache misses or system calls, which the
timing mode sees. Each cell takes a minute or two (the server runs 20-50x slower).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rerank_client import AsyncRerankClient

from rerank_server.bench.common import passages
from rerank_server.bench.processes import cpu_ns, fake_backend, start_server, stop
from rerank_server.bench.scenarios import backend_args

ROOT = Path(__file__).resolve().parent.parent


async def compare(
    trees: dict[str, Path],
    kind: str,
    size: int,
    requests: int,
    block: int,
    url: str,
    env: dict[str, str],
) -> str:
    servers: dict[str, tuple[int, subprocess.Popen[bytes]]] = {}
    try:
        for name, tree in trees.items():
            servers[name] = start_server(
                backend_args(kind, url), {"PYTHONPATH": str(tree), **env}, cwd=tree
            )
        docs = passages(size)
        clients = {
            name: AsyncRerankClient(f"127.0.0.1:{port}") for name, (port, _) in servers.items()
        }
        cpu = dict.fromkeys(servers, 0)
        latencies: dict[str, list[float]] = {name: [] for name in servers}
        for client in clients.values():
            for i in range(5):
                await client.rerank(f"warm {i}", docs)
        for b in range(max(requests // block, 1)):
            for name, client in clients.items():
                pid = servers[name][1].pid
                before = cpu_ns(pid)
                for i in range(block):
                    started = time.perf_counter()
                    await client.rerank(f"q {b} {i}", docs)
                    latencies[name].append(time.perf_counter() - started)
                cpu[name] += cpu_ns(pid) - before
        for client in clients.values():
            await client.close()
        pairs = len(latencies["old"]) * size
        cells = [
            f"{cpu[n] / pairs / 1000:6.1f} µs/pair, p50 "
            f"{statistics.median(latencies[n]) * 1000:5.2f} ms"
            for n in ("old", "new")
        ]
        return f"| {kind} | {size} | {cells[0]} | {cells[1]} | {cpu['new'] / cpu['old'] - 1:+.0%} |"
    finally:
        for _, proc in servers.values():
            stop(proc)


WARM_UP = 20  # requests before counting: connections, caches, the first-call paths


def _callgrind(pid: int, *command: str) -> None:
    # callgrind_control exits 0 even when it finds no such process under callgrind (a
    # Python launched through a wrapper script that execs: valgrind does not follow it).
    done = subprocess.run(
        ["callgrind_control", *command, str(pid)], check=True, capture_output=True, text=True
    )
    if "not detected" in done.stdout + done.stderr:
        raise RuntimeError(
            f"callgrind is not running process {pid}: is {sys.executable} "
            "a wrapper script rather than the interpreter itself?"
        )


def _counted(dump: Path) -> int:
    """The instructions in a callgrind dump (its `totals:` line)."""
    for line in dump.read_text().splitlines():
        if line.startswith("totals:"):
            return int(line.split()[1])
    raise RuntimeError(f"{dump} has no totals line")


async def _instructions_of(
    tree: Path, kind: str, size: int, requests: int, url: str, env: dict[str, str]
) -> float:
    """Instructions per request of the server in `tree`, counted by callgrind."""
    with tempfile.TemporaryDirectory() as out:
        dump = Path(out) / "callgrind.out"
        prefix = [
            "valgrind",
            "--quiet",
            "--tool=callgrind",
            "--instr-atstart=no",
            f"--callgrind-out-file={dump}",
        ]
        port, proc = start_server(
            backend_args(kind, url),
            {"PYTHONPATH": str(tree), **env},
            cwd=tree,
            prefix=prefix,
            start_timeout_s=300,
        )
        try:
            docs = passages(size)
            async with AsyncRerankClient(f"127.0.0.1:{port}") as client:
                for i in range(WARM_UP):
                    await client.rerank(f"warm {i}", docs)
                _callgrind(proc.pid, "--instr=on")
                for i in range(requests):
                    await client.rerank(f"q {i}", docs)
                _callgrind(proc.pid, "--instr=off")
                _callgrind(proc.pid, "--dump")
            return _counted(dump.with_name(dump.name + ".1")) / requests
        finally:
            stop(proc)


async def count(
    trees: dict[str, Path], kind: str, size: int, requests: int, url: str, env: dict[str, str]
) -> str:
    counted = {
        name: await _instructions_of(tree, kind, size, requests, url, env)
        for name, tree in trees.items()
    }
    cells = [
        f"{counted[n] / 1e6:6.3f} M/request, {counted[n] / size / 1e3:6.1f} k/pair"
        for n in ("old", "new")
    ]
    return (
        f"| {kind} | {size} | {cells[0]} | {cells[1]} | "
        f"{counted['new'] / counted['old'] - 1:+.1%} |"
    )


async def main(args: argparse.Namespace, old_tree: Path) -> None:
    trees = {"old": old_tree, "new": ROOT}
    # With the cache, every request is still a miss (each has its own query): what a
    # server deployed with the default cache pays to look pairs up and store them.
    env = {"RERANK_CACHE_ENTRIES": "50000"} if args.cache else {}
    measure = "instructions" if args.instructions else "CPU"
    print(f"| kind | candidates | old | new | {measure} change |\n|---|---|---|---|---|")
    with fake_backend() as url:
        for size in (int(s) for s in args.sizes.split(",")):
            for kind in args.kinds.split(","):
                cell = (
                    await count(trees, kind, size, args.requests, url, env)
                    if args.instructions
                    else await compare(trees, kind, size, args.requests, args.block, url, env)
                )
                print(cell, flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old_tree", help="a checkout of the version to compare against")
    parser.add_argument("--kinds", default="chat,ollama,completion,rerank,embedding,llm")
    parser.add_argument("--sizes", default="10,40,100")
    parser.add_argument("--requests", type=int, default=200, help="per version and cell")
    parser.add_argument("--block", type=int, default=25, help="requests per turn")
    parser.add_argument(
        "--cache",
        action="store_true",
        help="score cache on (the default deployment's), every request a miss",
    )
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="count instructions under callgrind instead of timing CPU",
    )
    if sys.platform != "linux" or not os.path.exists("/proc/self/task"):
        sys.exit("needs Linux /proc")
    arguments = parser.parse_args()
    asyncio.run(main(arguments, Path(arguments.old_tree).resolve()))
