"""The bytes of requests being worked on, server-wide, against `--max-inflight-bytes`.

Both edges take a request's wire size from the same `InflightBytes` before any work and
give it back when the answer is out, so `--max-inflight-bytes` bounds the memory of the
requests in progress over gRPC and HTTP together (docs/reliability.md). Refusing is
`Overloaded`: RESOURCE_EXHAUSTED on gRPC, 429 on HTTP. Whether a request's pairs go to
the backend at all is another decision (`pair_admission.py`).
"""

from __future__ import annotations

from collections.abc import Callable


class Overloaded(Exception):
    """The server-wide budget for request bytes in flight is spent."""


class InflightBytes:
    """The bytes of requests being worked on, against a server-wide budget. A request
    larger than the whole budget is still taken when nothing else is in flight."""

    def __init__(self, limit: int, released: Callable[[int], None] | None = None) -> None:
        self.limit = limit
        self.used = 0
        self._released = released  # told of every size given back (`allocator`)

    def take(self, size: int, own: int = 0) -> None:
        """Count `size` more bytes; `own` of those in flight are the same request's
        (taken as its body arrived), so a request alone may still exceed the budget."""
        if self.used + size > self.limit and self.used > own:
            raise Overloaded(
                f"server busy: {self.used // 1024} KiB of requests in progress "
                f"(max_inflight_bytes {self.limit // 1024} KiB); retry with "
                "backoff"
            )
        self.used += size

    def give_back(self, size: int) -> None:
        self.used -= size
        if self._released is not None:
            self._released(size)
