"""Time `chat` (one call per pair) against `completion` (one batched call) on a real
llama-server, side by side in one run.

Usage: python scripts/bench_backends.py [--rounds 6] [--passages 20] [--slots 4]
                                        [--out bench-results/backends.json]

Starts llama-server (the cached build and stand-in model from `make assets`) with
`--slots` slots, and two rerank-servers on it, one per backend, with the score cache off
and concurrency equal to the slots. Each round reranks `--passages` TREC DL 2019 passages
(../shared/data, read in place) through each backend, each with a query of its own
(identical prompts would hit the slots' prompt cache), alternating which goes first so
drift hits both alike. Reports the median wall time per backend and the ratio.
The issue 6 benchmark tool will take this over.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from rerank_client import AsyncRerankClient

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from rerank_server import assets, logs  # noqa: E402
from rerank_server.managed import free_port  # noqa: E402
from rerank_server.server import build_server  # noqa: E402
from rerank_server.settings import LogFormat, Settings  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "trec_dl19_passage_subset"


def load(passages: int, rounds: int) -> tuple[list[str], list[str]]:
    docs = []
    with (DATA / "corpus.jsonl").open() as f:
        for line in f:
            docs.append(json.loads(line)["text"])
            if len(docs) == passages:
                break
    with (DATA / "queries.jsonl").open() as f:
        queries = [json.loads(line)["text"] for line in f][:rounds]
    return docs, queries


def start_llama(slots: int) -> tuple[subprocess.Popen[bytes], str]:
    cache = Settings().cache_dir
    binary = assets.resolve_llama_server(None, cache, build=False)
    model = assets.resolve_model(None, cache, fetch_missing=False)
    port = free_port()
    proc = subprocess.Popen([str(binary), "-m", str(model), "--port", str(port),
                             "-np", str(slots), "-c", str(slots * 2048), "--no-webui"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("llama-server did not start")


async def run(args: argparse.Namespace) -> dict[str, object]:
    logs.configure("warning", LogFormat.JSON)
    # Each backend gets its own query every round: the same prompt twice would be served
    # from the slots' KV cache the second time (cache_prompt), flattering whoever is second.
    docs, queries = load(args.passages, 2 * (args.rounds + 1))
    proc, url = start_llama(args.slots)
    try:
        servers = {}
        for kind in ("chat", "completion"):
            settings = Settings(port=0, backend=kind, backend_url=url, concurrency=args.slots,
                                max_candidates=args.passages, max_batch=args.passages,
                                cache_entries=0, metrics=False, probe=False,
                                assistant_prefill=False, timeout_ms=120_000)
            servers[kind] = await build_server(settings)
        times: dict[str, list[float]] = {k: [] for k in servers}
        for r in range(args.rounds + 1):
            order = list(servers) if r % 2 == 0 else list(reversed(servers))
            for kind in order:
                query = queries[2 * r + list(servers).index(kind)]
                async with AsyncRerankClient(f"127.0.0.1:{servers[kind].port}") as client:
                    started = time.perf_counter()
                    answer = await client.rerank(query, docs)
                    elapsed = time.perf_counter() - started
                if not answer.reranked or answer.summary.failed:
                    raise SystemExit(f"{kind}: {answer.summary}")
                if r > 0:  # round 0 warms both up
                    times[kind].append(elapsed * 1000)
        for server in servers.values():
            await server.stop(grace=0)
    finally:
        proc.terminate()
        proc.wait(10)
    medians = {k: statistics.median(v) for k, v in times.items()}
    return {"passages": args.passages, "slots": args.slots, "rounds": args.rounds,
            "median_ms": medians, "all_ms": times,
            "completion_vs_chat": medians["completion"] / medians["chat"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--passages", type=int, default=20)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("bench-results/backends.json"))
    args = parser.parse_args()
    report = asyncio.run(run(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    medians = report["median_ms"]
    assert isinstance(medians, dict)
    print(f"{args.passages} passages, {args.slots} slots, {args.rounds} rounds (medians):")
    for kind, ms in medians.items():
        print(f"  {kind:<10} {ms:8.0f} ms")
    print(f"  completion / chat = {report['completion_vs_chat']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
