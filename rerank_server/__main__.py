"""Allow `python -m rerank_server`."""

import sys

from .cli import main

sys.exit(main())
