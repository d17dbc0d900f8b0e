"""CPU an idle rerank-server uses, in milliseconds a second.

Usage: python scripts/idle_cpu.py [OLD_TREE] [--seconds 30] [--rounds 3]

A sidecar runs beside every pod and is idle most of the time, so what it burns doing
nothing is paid many times over. This starts a server as deployed (metrics, the JSON API,
the start-up probe and the score cache on) against the bench's instant fake backend,
sends no request after the probe, waits for start-up to settle, and reads the CPU time of
every thread of the process (`/proc/PID/task/*/schedstat`, nanoseconds) over `--seconds`.
With OLD_TREE (a checkout, e.g. `git worktree add /tmp/old <rev>`) the two versions take
turns, one server at a time, so both see the same minutes.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rerank_server.bench.processes import cpu_ns, fake_backend, start_server, stop
from rerank_server.bench.scenarios import backend_args

ROOT = Path(__file__).resolve().parent.parent
SETTLE_S = 6.0  # start-up's probe, the first health poll, imports finishing
DEPLOYED = {
    "RERANK_METRICS": "1",
    "RERANK_METRICS_PORT": "0",
    "RERANK_HTTP_PORT": "0",
    "RERANK_PROBE": "1",
    "RERANK_CACHE_ENTRIES": "50000",
}


def idle_ms_per_s(tree: Path, url: str, seconds: float) -> float:
    _, proc = start_server(
        backend_args("chat", url), {"PYTHONPATH": str(tree), **DEPLOYED}, cwd=tree
    )
    try:
        time.sleep(SETTLE_S)
        before = cpu_ns(proc.pid)
        time.sleep(seconds)
        return (cpu_ns(proc.pid) - before) / 1e6 / seconds
    finally:
        stop(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old_tree", nargs="?", type=Path)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    trees = {"new": ROOT} if args.old_tree is None else {"old": args.old_tree, "new": ROOT}
    with fake_backend() as url:
        for r in range(args.rounds):
            cells = [
                f"{name} {idle_ms_per_s(tree, url, args.seconds):.2f} ms/s"
                for name, tree in trees.items()
            ]
            print(f"round {r + 1}: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
