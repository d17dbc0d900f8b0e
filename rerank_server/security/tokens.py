"""Inbound bearer tokens: `--auth-tokens` and `--auth-tokens-file`, each with the name it
is shown by and its limits (docs/security.md, "Bearer tokens", "Per-token limits").

Compared in constant time against every configured token. A token is never logged nor
put in an error message: its name stands for it.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from .limits import (
    ANONYMOUS,
    CONCURRENT,
    PAIRS_PER_MINUTE,
    RPS,
    Caller,
    LimitCounter,
    Limiter,
    Limits,
    Places,
    Priority,
)

SCHEME = "bearer"
MIN_LENGTH = 16
FLAG = "--auth-tokens / RERANK_AUTH_TOKENS"
FILE = "--auth-tokens-file / RERANK_AUTH_TOKENS_FILE"
KEYS = ("name", RPS, PAIRS_PER_MINUTE, CONCURRENT, "priority")
# What logs, metrics and Redis keys can carry as they are.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# A key shown in an error message only when it looks like one (a field of a token split
# by a stray space must not be echoed).
_KEYLIKE = re.compile(r"[a-z_]{1,32}")
_WHOLE = re.compile(r"[0-9]{1,12}")


@dataclass(frozen=True, slots=True)
class _Entry:
    token: str
    caller: Caller
    where: str  # for messages, never the token: the setting and the line, or position
    short: str  # "line 3": where, for a message about another entry
    configured: bool  # the line has settings of its own


class TokenSet:
    """The accepted tokens, each with its caller (name and limits); an empty set means
    authentication is off. Owns the `Limiter` both edges count the limits through."""

    def __init__(
        self, entries: Iterable[tuple[str, Caller]] = (), counter: LimitCounter | None = None
    ) -> None:
        self._tokens = tuple((token.encode(), caller) for token, caller in entries if token)
        self.limiter = Limiter(counter)
        self._high = any(c.limits.priority is Priority.HIGH for _, c in self._tokens)

    @classmethod
    def load(cls, tokens: str, tokens_file: str, counter: LimitCounter | None = None) -> TokenSet:
        """From the comma-separated flag (no limits) and a file of one token a line,
        `TOKEN [key=value ...]` (`#` comments). ConfigError naming the line and the key
        of what is wrong."""
        entries: list[_Entry] = []
        for position, token in enumerate((t.strip() for t in tokens.split(",") if t.strip()), 1):
            if len(token) < MIN_LENGTH:
                raise ConfigError(f"{FLAG}: every token must have at least {MIN_LENGTH} characters")
            where = f"{FLAG}: token {position}"
            entries.append(_Entry(token, Caller(f"auth-tokens-{position}"), where, where, False))
        if tokens_file:
            try:
                lines = Path(tokens_file).expanduser().read_text().splitlines()
            except OSError as exc:
                raise ConfigError(f"{FILE}: cannot read {tokens_file}: {exc.strerror}") from None
            for number, line in enumerate(lines, 1):
                fields = line.split()
                if fields and not fields[0].startswith("#"):
                    entries.append(_parse_line(f"{FILE}: {tokens_file}", number, fields))
        return cls(((e.token, e.caller) for e in _distinct(entries)), counter)

    @property
    def enabled(self) -> bool:
        return bool(self._tokens)

    def places(self, cap: int) -> Places:
        """`cap` calls in progress, shared out by priority (`limits.places`); `normal`
        keeps room for `high` only when a token is high."""
        return Places(cap, self._high)

    def identify(self, authorization: str | None) -> Caller | None:
        """The caller whose token an `authorization` value carries; None when it carries
        none that is accepted; `ANONYMOUS` for everyone when authentication is off."""
        if not self._tokens:
            return ANONYMOUS
        scheme, _, presented = (authorization or "").strip().partition(" ")
        if scheme.lower() != SCHEME or not presented:
            return None
        candidate = presented.strip().encode()
        found = None
        for token, caller in self._tokens:  # no early exit: the time does not depend on which
            if hmac.compare_digest(candidate, token):
                found = caller
        return found

    def accepts(self, authorization: str | None) -> bool:
        """Whether an `authorization` value carries an accepted token (always, when off)."""
        return self.identify(authorization) is not None


def _parse_line(source: str, number: int, fields: list[str]) -> _Entry:
    """Line `number` of the tokens file: `TOKEN` alone, or with `key=value` settings."""
    where = f"{source} line {number}"
    token, settings = fields[0], fields[1:]
    if len(token) < MIN_LENGTH:
        raise ConfigError(f"{where}: the token must have at least {MIN_LENGTH} characters")
    values: dict[str, str] = {}
    for position, field in enumerate(settings, 2):
        key, equals, value = field.partition("=")
        if not equals:
            raise ConfigError(
                f"{where}: field {position} is not key=value (keys: {', '.join(KEYS)}; "
                "a token has no spaces)"
            )
        if key not in KEYS:
            shown = f"'{key}'" if _KEYLIKE.fullmatch(key) else f"of field {position}"
            raise ConfigError(f"{where}: unknown key {shown} (keys: {', '.join(KEYS)})")
        if key in values:
            raise ConfigError(f"{where}: {key} is given twice")
        values[key] = value
    name = values.pop("name", f"token-{number}")
    if not NAME.fullmatch(name):
        raise ConfigError(
            f"{where}: name must be 1 to 64 letters, digits, '.', '_' or '-', starting "
            "with a letter or digit"
        )
    priority = values.pop("priority", Priority.NORMAL.value)
    try:
        level = Priority(priority)
    except ValueError:
        raise ConfigError(f"{where}: priority must be high, normal or low") from None
    counts = {key: _whole(where, key, value) for key, value in values.items()}
    limits = Limits(
        rps=counts.get(RPS),
        pairs_per_minute=counts.get(PAIRS_PER_MINUTE),
        concurrent=counts.get(CONCURRENT),
        priority=level,
    )
    return _Entry(token, Caller(name, limits), where, f"line {number}", bool(settings))


def _whole(where: str, key: str, value: str) -> int:
    if not _WHOLE.fullmatch(value) or int(value) < 1:
        raise ConfigError(f"{where}: {key} must be a whole number of at least 1")
    return int(value)


def _distinct(entries: list[_Entry]) -> list[_Entry]:
    """`entries` without repeats: a token listed twice plainly counts once; listed twice
    with settings it is ambiguous. Tokens sharing a
    name share its limits (rotation: the old and the new token of one service), so
    they must give the same."""
    by_token: dict[str, _Entry] = {}
    by_name: dict[str, _Entry] = {}
    for entry in entries:
        first = by_token.get(entry.token)
        if first is not None:
            if entry.configured or first.configured:
                raise ConfigError(
                    f"{entry.where}: the same token as {first.short}, with settings: "
                    "keep one of them"
                )
            continue
        named = by_name.setdefault(entry.caller.name, entry)
        if named.caller.limits != entry.caller.limits:
            raise ConfigError(
                f"{entry.where}: name '{entry.caller.name}' is also {named.short}'s, with "
                "other limits: tokens that share a name share its limits, so give them "
                "the same"
            )
        by_token[entry.token] = entry
    return list(by_token.values())
