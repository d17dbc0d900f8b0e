"""Errors raised on purpose, each with one meaning for whoever catches it."""

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


class BindError(OSError):
    """A listening address is taken or cannot be bound; names the setting to change."""

    def __init__(self, setting: str, address: str, reason: str = "") -> None:
        detail = f": {reason}" if reason else ""
        super().__init__(
            f"cannot listen on {address} ({setting}){detail}; is another server using that port?"
        )
        self.setting = setting
        self.address = address


class StartError(RuntimeError):
    """Something the server runs or builds before serving failed; the message says what
    and where its output went."""
