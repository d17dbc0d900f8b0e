"""Inbound bearer tokens: `--auth-tokens` and `--auth-tokens-file`.

Compared in constant time against every configured token; never logged.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from pathlib import Path

from ..errors import ConfigError

SCHEME = "bearer"


class TokenSet:
    """The accepted tokens; an empty set means authentication is off."""

    def __init__(self, tokens: Iterable[str] = ()) -> None:
        self._tokens = tuple(t.encode() for t in tokens if t)

    @classmethod
    def load(cls, tokens: str, tokens_file: str) -> TokenSet:
        """From the comma-separated flag and a file of one token per line (`#` comments)."""
        found = [t.strip() for t in tokens.split(",")]
        if tokens_file:
            try:
                lines = Path(tokens_file).expanduser().read_text().splitlines()
            except OSError as exc:
                raise ConfigError(
                    f"--auth-tokens-file / RERANK_AUTH_TOKENS_FILE: cannot read "
                    f"{tokens_file}: {exc.strerror}"
                ) from None
            found += [line.strip() for line in lines if not line.lstrip().startswith("#")]
        short = [t for t in found if t and len(t) < 16]
        if short:
            raise ConfigError(
                "--auth-tokens / RERANK_AUTH_TOKENS: every token must have at least 16 characters"
            )
        return cls(t for t in found if t)

    @property
    def enabled(self) -> bool:
        return bool(self._tokens)

    def accepts(self, authorization: str | None) -> bool:
        """Whether an `authorization` value carries an accepted token (always, when off)."""
        if not self._tokens:
            return True
        scheme, _, presented = (authorization or "").strip().partition(" ")
        if scheme.lower() != SCHEME or not presented:
            return False
        candidate = presented.strip().encode()
        matched = False
        for token in self._tokens:  # no early exit: the time does not depend on which
            matched |= hmac.compare_digest(candidate, token)
        return matched
