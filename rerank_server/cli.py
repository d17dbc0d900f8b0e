"""`rerank-server`: run the server (the default), or a subcommand.

    rerank-server [FLAGS]            serve (see --help for every setting)
    rerank-server prepare [FLAGS]    build/fetch the managed mode's assets into the cache
    rerank-server healthcheck        exit 0 if a running server's health says SERVING
    rerank-server eval DATASET       ranking quality: BM25 vs reranked (needs the eval extra)
    rerank-server bench              speed: overhead, efficiency, throughput, streaming
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from . import settings
from .errors import ConfigError
from .loops import loop_factory
from .observability import logs
from .server import serve


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["prepare"]:
        from .managed import assets
        return assets.main(args[1:])
    if args[:1] == ["bench"]:
        from .bench import run as bench
        return bench.main(args[1:])
    if args[:1] == ["eval"]:
        from .evaluation import run
        return run.main(args[1:])
    if args[:1] == ["healthcheck"]:
        from .api import healthcheck
        return healthcheck.main(args[1:])
    try:
        parser = settings.build_parser()
        config = settings.load(args, parser=parser)
    except ConfigError as exc:
        print(f"rerank-server: error: {exc}", file=sys.stderr)
        return 2
    logs.configure(config.log_level, config.log_format)
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
