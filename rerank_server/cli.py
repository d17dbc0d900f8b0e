"""`rerank-server`: run the server (the default), or a subcommand (`SUBCOMMANDS`).

Errors end with one line on stderr and status 2 (fixable) or 1 (`StartError`), no traceback.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence

from . import settings
from .errors import BindError, ConfigError, StartError
from .loops import loop_factory
from .observability import logs
from .workers import run

# name -> (module with `main(argv) -> int`, one line for --help, optional extra it needs)
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "prepare": (
        "rerank_server.managed.assets",
        "build llama-server and fetch the models for managed mode into the cache",
        "",
    ),
    "healthcheck": (
        "rerank_server.api.healthcheck",
        "exit 0 if a running server's gRPC health says SERVING",
        "",
    ),
    "eval": (
        "rerank_server.evaluation.run",
        "ranking quality on a BEIR data set: BM25 against each blend",
        "eval",
    ),
    "fit": (
        "rerank_server.evaluation.fit_command",
        "fit a blend profile across data sets from eval outputs",
        "eval",
    ),
    "bench": (
        "rerank_server.bench.run",
        "speed: overhead, telemetry, efficiency, throughput, streaming",
        "bench",
    ),
}
# What the optional extra installs (pyproject.toml, [project.optional-dependencies]), by
# top-level module: looked for before a tool starts, so it fails before any work.
EXTRA_MODULES = {
    "eval": ("bm25s", "Stemmer", "ranx", "tqdm", "matplotlib", "numpy", "scipy"),
    # Plots only: a GPU machine measuring its backend needs no BM25 or metrics.
    "bench": ("matplotlib",),
}


def subcommands_help() -> str:
    lines = ["subcommands (rerank-server SUBCOMMAND --help for theirs):"]
    lines += [f"  {name:<12} {line}" for name, (_, line, _) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # in sys.modules as None: blocked on purpose
        return False


def _subcommand(name: str) -> Callable[[Sequence[str]], int] | str:
    """The subcommand's `main`, or the one line to print when its extra is missing."""
    module, _, extra = SUBCOMMANDS[name]
    missing = [m for m in EXTRA_MODULES.get(extra, ()) if not _installed(m)]
    if missing:
        return (
            f"rerank-server {name} needs the optional '{extra}' dependencies "
            f"(missing: {', '.join(missing)}): pip install 'rerank-server[{extra}]'"
        )
    main: Callable[[Sequence[str]], int] = importlib.import_module(module).main
    return main


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] and args[0] in SUBCOMMANDS:
        command = _subcommand(args[0])
        if isinstance(command, str):
            print(f"rerank-server: error: {command}", file=sys.stderr)
            return 2
        return command(args[1:])
    try:
        parser = settings.build_parser(epilog=subcommands_help())
        config = settings.load(args, parser=parser)
    except ConfigError as exc:
        print(f"rerank-server: error: {exc}", file=sys.stderr)
        return 2
    logs.configure(config.log_level, config.log_format)
    try:
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            runner.run(run(config))
    except (BindError, ConfigError) as exc:
        print(f"rerank-server: error: {exc}", file=sys.stderr)
        return 2
    except StartError as exc:
        print(f"rerank-server: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # Ctrl-C before the server's own signal handlers are in place (a managed
        # llama-server loading, the assets building): the runner has cancelled the start,
        # which stops the child; a traceback would say nothing more.
        print("rerank-server: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
