"""What every scorer shares: its backend pool, and the model's name.

The name is the configured `--model` when there is one; otherwise the backend's own, read
from `/v1/models` when the backend comes up and from the `model` field of its answers.
It goes into responses and into score-cache keys.
"""

from __future__ import annotations

from typing import Any

from .backend_pool import BackendPool, model_name, served_model


class PooledScorer:
    def __init__(self, pool: BackendPool, model: str = "") -> None:
        self._pool = pool
        self._configured_model = model
        self._reported_model = ""

    @property
    def model(self) -> str:
        return self._configured_model or self._reported_model

    async def discover_model(self) -> None:
        if not self._configured_model:
            self._reported_model = await served_model(self._pool) or self._reported_model

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
