"""Allow `python -m rerank_server`."""

import sys

from .cli import main

# Guarded: `--workers` starts its workers with multiprocessing's spawn, which imports this
# module again in each of them (as `__mp_main__`).
if __name__ == "__main__":
    sys.exit(main())
