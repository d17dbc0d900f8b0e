"""How a backend call failed, and what llama-server's error answers say about the input."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import orjson

from ..base import Failure

# error.type values on metrics and spans, by failure kind.
ERROR_TYPES = {
    Failure.TIMEOUT: "timeout",
    Failure.UNAVAILABLE: "connect",
    Failure.HTTP_ERROR: "http_status",
    Failure.MALFORMED: "malformed",
}


class MalformedResponse(ValueError):
    """The backend answered, but not with what the scorer needs (no user text inside).

    Raised by a scorer's parser, or by its decoder (`post_json(decode=...)`) for JSON of
    the wrong shape: either way the instance did answer, which its health counts."""


# A scorer's own decoder of an answer's bytes: raises MalformedResponse for JSON of the
# wrong shape, and anything else for bytes that are not JSON.
Decode = Callable[[bytes], Any]


class BackendCallError(Exception):
    """One backend call failed; `failure` says how, `detail` says what (no user text).

    `too_long`: the backend refused the input as longer than its context (llama-server's
    `exceed_context_size_error`, or "too large" for embeddings): worth one more try with a
    shorter document. `limit_tokens`: the limit the refusal named, where it named one
    (llama-server's embedding refusal names its physical batch, `-ub`).
    """

    def __init__(
        self,
        failure: Failure,
        detail: str,
        status: int = 0,
        too_long: bool = False,
        limit_tokens: int | None = None,
    ) -> None:
        super().__init__(detail)
        self.failure = failure
        self.detail = detail
        self.status = status
        self.limit_tokens = limit_tokens
        self.too_long = too_long


def too_long(body: bytes) -> bool:
    """Whether an error answer says the input was longer than the model's context."""
    try:
        error = orjson.loads(body).get("error", {})
    except (orjson.JSONDecodeError, AttributeError):
        return False
    if not isinstance(error, dict):
        return False
    message = str(error.get("message", "")).lower()
    return (
        error.get("type") == "exceed_context_size_error"
        or "exceeds the available context" in message
        or "too large" in message
    )


# llama-server: "input (302 tokens) is too large to process. increase the physical batch
# size (current batch size: 128)".
_PHYSICAL_BATCH = re.compile(rb"current batch size: (\d{1,9})\)")


def physical_batch(body: bytes) -> int | None:
    """The physical batch (`-ub`) an embedding refusal names, if it names one."""
    found = _PHYSICAL_BATCH.search(body[:4096])
    return int(found.group(1)) if found else None
