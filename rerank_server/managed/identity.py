"""A model file's identity for the score cache: its sha256, so that replicas serving
different files under one name never share scores (docs/api.md, "Score cache")."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .downloads import sha256_of
from .hub_cache import SHA256


def model_identity(model: Path, cache: Path) -> str:
    """`sha256:<hex>` of the file `model`: read from the hub cache's blob name when it is
    one, else hashed once and remembered in `cache/model-digests.json` by path, size
    and modification time (a multi-gigabyte file takes seconds to hash; it is hashed
    while its llama-server loads)."""
    real = model.resolve()
    # A file in the hub's cache is stored under its sha256 (`blobs/<sha256>`).
    if SHA256.match(real.name) and real.parent.name == "blobs":
        return f"sha256:{real.name}"
    stat = real.stat()
    key = f"{real}|{stat.st_size}|{stat.st_mtime_ns}"
    memo = cache / "model-digests.json"
    try:
        known = json.loads(memo.read_text())
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):
        known = {}
    digest = known.get(key)
    if not isinstance(digest, str):
        digest = sha256_of(real)
        known[key] = digest
        try:  # a read-only cache only costs the hash again next start
            tmp = memo.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(known))
            os.replace(tmp, memo)
        except OSError:
            pass
    return f"sha256:{digest}"
