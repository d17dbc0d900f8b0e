"""`rerank-server bench`: what rerank-server costs and what it delivers, side by side.

The scenarios (`common.SCENARIOS`, `common.OPT_IN`) and their results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..managed import assets
from ..settings import load
from . import physical
from .common import GRID, OPT_IN, SCENARIOS, SIZES, SLOTS, TELEMETRY_CANDIDATES, passages
from .direct import DIRECT_KINDS
from .model_scenario import Eager, model
from .processes import fake_backend, llama_server
from .report import markdown, plots
from .scenarios import backends, completion_options, overhead, settings_grid, streaming, throughput
from .telemetry import KINDS as TELEMETRY_KINDS
from .telemetry import telemetry_cost


async def run(args: argparse.Namespace) -> dict[str, Any]:
    chosen = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = set(chosen) - set(SCENARIOS) - set(OPT_IN)
    if unknown:
        raise SystemExit(f"unknown scenarios: {', '.join(sorted(unknown))}")
    report: dict[str, Any] = {
        "machine": f"{platform.machine()}, {platform.python_implementation()} "
        f"{platform.python_version()}, {len(os.sched_getaffinity(0))} "
        "CPUs",
        "command": "rerank-server bench " + " ".join(sys.argv[2:]),
    }
    if "overhead" in chosen:
        report["overhead"] = await overhead(args.requests)
    if "telemetry" in chosen:
        with fake_backend() as url:
            report["telemetry"] = {
                kind: await telemetry_cost(
                    url, args.requests * 10, passages(TELEMETRY_CANDIDATES), kind
                )
                for kind in TELEMETRY_KINDS
            }
    if "throughput" in chosen:
        report["throughput"] = await throughput(
            args.seconds, [int(w) for w in args.workers.split(",")]
        )
    needs_llama = [s for s in ("model", "streaming", "backends") if s in chosen]
    if needs_llama:
        # An external backend (a GPU llama-server, vLLM, TEI) when given, else the cached
        # CPU build with the stand-in model.
        external = bool(args.backend_url)
        slots = args.slots if external else SLOTS
        label = f"{args.backend_url} ({args.backend})" if external else "llama-server"
        if external:
            report["backend_under_test"] = label
        with contextlib.nullcontext(args.backend_url) if external else llama_server(SLOTS) as llama:
            if "model" in chosen:
                report["model"] = await model(
                    llama,
                    args.rounds,
                    args.passages,
                    args.backend,
                    slots,
                    [int(n) for n in args.clients.split(",") if n],
                    args.seconds,
                    _eager_setting(args, external),
                )
            if "streaming" in chosen:
                report["streaming"] = await streaming(
                    llama,
                    args.rounds,
                    args.stream_latency_ms,
                    [int(n) for n in args.stream_sizes.split(",")],
                    args.backend,
                    slots,
                    "external" if external else label,
                )
            # chat against completion is a llama-server comparison of one model.
            if "backends" in chosen and args.backend == "chat":
                report["backends"] = await backends(llama, args.rounds, args.passages, slots)
    if "completion-options" in chosen:
        with (
            contextlib.nullcontext(args.backend_url)
            if args.backend_url
            else llama_server(SLOTS) as llama
        ):
            report["completion_options"] = await completion_options(
                llama, args.rounds, args.passages
            )
    if "settings" in chosen:
        grid = [tuple(int(v) for v in cell.split(":")) for cell in args.grid.split(",")]
        report["settings"] = await settings_grid(
            [(np, ub) for np, ub in grid], args.rounds, args.passages
        )
    return report


def _eager_setting(args: argparse.Namespace, external: bool) -> Eager:
    if args.no_eager:
        return Eager(skipped="--no-eager")
    cache = load([]).cache_dir
    model_path = args.eager_model or (
        None if external else assets.resolve_stand_in(cache, fetch_missing=False)
    )
    if model_path is None:
        return Eager(skipped="--eager-model names the GGUF that --backend-url serves")
    python = args.eager_python or physical.torch_python(cache)
    if python is None:
        return Eager(
            skipped="no Python with torch and gguf (--eager-python, or "
            "`rerank-server prepare --speed-twin q8_0` builds one)"
        )
    return Eager(model_path, python)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rerank-server bench", description=__doc__.split("\n")[0])
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument(
        "--requests",
        type=int,
        default=100,
        help="overhead: requests per backend and size (telemetry: 10x)",
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=5.0,
        help="throughput and model --clients: seconds per level",
    )
    parser.add_argument(
        "--workers",
        default=",".join(map(str, sorted({1, os.cpu_count() or 1}))),
        help="throughput: the --workers settings to compare",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="llama-server scenarios: measured rounds (plus one warm-up)",
    )
    parser.add_argument(
        "--clients",
        default="",
        help="model scenario: also pairs/s with these many clients at "
        "once, each for --seconds, directly and through (e.g. 1,4,16)",
    )
    parser.add_argument(
        "--passages", type=int, default=20, help="llama-server scenarios: passages per request"
    )
    parser.add_argument(
        "--grid",
        default=",".join(f"{np}:{ub}" for np, ub in GRID),
        help="settings: llama-server -np:-ub cells",
    )
    parser.add_argument(
        "--stream-latency-ms",
        type=float,
        default=300.0,
        help="streaming: the fixed-latency backend's time per call",
    )
    parser.add_argument(
        "--stream-sizes",
        default=",".join(map(str, SIZES)),
        help="streaming: candidates per request",
    )
    parser.add_argument(
        "--backend-url",
        default="",
        help="model, streaming, backends: measure against this running "
        "backend instead of the cached llama-server build",
    )
    parser.add_argument(
        "--backend", default="chat", choices=DIRECT_KINDS, help="the kind of --backend-url"
    )
    parser.add_argument(
        "--slots",
        type=int,
        default=SLOTS,
        help="--backend-url's parallel slots: the concurrency of both "
        "the direct client and rerank-server",
    )
    parser.add_argument(
        "--eager-model",
        type=Path,
        default=None,
        help="model: the GGUF that --backend-url serves, for the physical "
        "limit (the stand-in when bench starts llama-server)",
    )
    parser.add_argument(
        "--eager-python",
        type=Path,
        default=None,
        help="model: a Python with torch and gguf for the physical limit "
        "(default: this one if it has them, else the converter's)",
    )
    parser.add_argument("--no-eager", action="store_true", help="model: skip the physical limit")
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    args = parser.parse_args(argv)
    if args.backend != "chat" and not args.backend_url:
        parser.error("--backend needs --backend-url (the cached build serves chat)")
    report = asyncio.run(run(args))
    args.out.mkdir(parents=True, exist_ok=True)
    report["plots"] = plots(report, args.out)
    (args.out / "bench.json").write_text(json.dumps(report, indent=1) + "\n")
    text = markdown(report)
    (args.out / "bench.md").write_text(text)
    print(text)
    return 0
