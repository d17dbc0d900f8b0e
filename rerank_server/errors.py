"""Errors the core raises on purpose; the service maps each to one gRPC status."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """The request breaks a rule; `field` names the offending field (e.g. `candidates[3].id`).

    Messages name fields and numbers only, never query or document text, because they are
    logged and returned to callers.
    """

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


class ConfigError(ValueError):
    """A setting has a value the server cannot run with."""
