"""What every scorer shares: its backend pool, and the model's name.

The name is `--model`, else the backend's own (`served_model`, and its answers' `model`).
"""

from __future__ import annotations

from typing import Any

from ..calls import CallTasks
from ..transport.pool import BackendPool


class PooledScorer:
    """Every scorer's base: the backend pool it calls through, and the model's name."""

    # Pairs per backend call: one for the per-pair backends; the batching ones set their
    # `--max-batch`. Admission needs it: one call of 40 pairs is not spread over the slots.
    _max_batch = 1

    def __init__(self, pool: BackendPool, model: str = "") -> None:
        self._pool = pool
        self._configured_model = model
        self._reported_model = ""
        self._variant = ""  # what a scorer's scores depend on besides model and pair

    @property
    def model(self) -> str:
        return self._configured_model or self._reported_model

    @property
    def calls(self) -> CallTasks:
        return self._pool.calls

    @property
    def variant(self) -> str:
        """What the scores depend on besides the model and the pair (`Scorer.variant`):
        its prompt's fixed text, set by each scorer that has one; none by default."""
        return self._variant

    async def discover_model(self) -> None:
        if not self._configured_model:
            self._reported_model = await served_model(self._pool) or self._reported_model

    def estimate_s(self, pairs: int, outstanding: int = 0) -> float:
        return self._pool.estimate_s(pairs, self._max_batch, outstanding)

    def note_model(self, reported: Any) -> None:
        """Remember the model an answer names (llama-server names its file path)."""
        if isinstance(reported, str) and reported:
            self._reported_model = model_name(reported)

    def with_model(self, body: dict[str, Any]) -> dict[str, Any]:
        """`body` with the configured model name, when there is one."""
        if self._configured_model:
            body["model"] = self._configured_model
        return body

    async def aclose(self) -> None:
        """Nothing to close: the pool belongs to whoever made it (`server.build_server`)."""


MAX_MODEL_CHARS = 256


def model_name(reported: str) -> str:
    """llama-server reports the model's file path; callers need only its name. At most
    MAX_MODEL_CHARS of it: the name goes into every answer, log line and cache key, and
    a name of unbounded length could make every answer too large to send."""
    return reported.rsplit("/", 1)[-1][:MAX_MODEL_CHARS]


async def served_model(pool: BackendPool) -> str:
    """The first model an OpenAI-style `/v1/models` lists, else TEI's `/info` `model_id`;
    "" when neither can be read."""
    body = await pool.get_json("/v1/models")
    data = body.get("data") if isinstance(body, dict) else None
    if (
        isinstance(data, list)
        and data
        and isinstance(data[0], dict)
        and isinstance(data[0].get("id"), str)
    ):
        return model_name(data[0]["id"])
    info = await pool.get_json("/info")
    if isinstance(info, dict) and isinstance(info.get("model_id"), str) and info["model_id"]:
        return model_name(info["model_id"])
    return ""
