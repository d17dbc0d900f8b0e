"""Fitted blend profiles: request-wide blend parameters for one backend and model.

The file, the matching and the scripts: docs/blending.md, "Blend profiles".
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from fnmatch import fnmatchcase
from importlib import resources
from pathlib import Path
from typing import Any

import structlog

from ..domain import BlendStrategy
from ..errors import ConfigError
from .blending import ADAPTIVE, NO_WEIGHT, AdaptiveParams
from .scripts import reads

log = structlog.get_logger(__name__)

SHIPPED = "blend_profiles.json"
_OPTION = "--blend-profile / RERANK_BLEND_PROFILE"
_PARAMS = tuple(f.name for f in fields(AdaptiveParams))


@dataclass(frozen=True, slots=True)
class BlendProfile:
    """One fitted profile: the request-wide blend's parameters for a backend and model."""

    name: str
    backend: str
    model: str  # shell-style pattern over the served model's name
    params: AdaptiveParams
    fitted: dict[str, Any] = field(default_factory=dict)
    scripts: tuple[str, ...] = ()  # what its model reads (`scripts.py`); empty: any

    def matches(self, backend: str, model: str) -> bool:
        return backend == self.backend and bool(model) and fnmatchcase(model, self.model)

    def reads(self, script: str) -> bool:
        """Whether its model reads text mostly in `script` (`scripts.reads`)."""
        return reads(self.scripts, script)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "backend": self.backend, "model": self.model}
        if self.scripts:
            out["scripts"] = list(self.scripts)
        out.update({p: getattr(self.params, p) for p in _PARAMS})
        if self.fitted:
            out["fitted"] = self.fitted
        return out


@dataclass(frozen=True, slots=True)
class BlendProfiles:
    """The loaded profiles, in file order; `source` names where they came from."""

    profiles: tuple[BlendProfile, ...]
    source: str

    def find(self, backend: str, model: str) -> BlendProfile | None:
        return next((p for p in self.profiles if p.matches(backend, model)), None)

    def with_profile(self, profile: BlendProfile) -> BlendProfiles:
        """These profiles with `profile` first, replacing one of the same name."""
        rest = tuple(p for p in self.profiles if p.name != profile.name)
        return BlendProfiles((profile, *rest), self.source)

    def to_json(self) -> dict[str, Any]:
        return {"profiles": [p.to_json() for p in self.profiles]}


@dataclass(frozen=True, slots=True)
class Blend:
    """The blend that ranks a request: strategy, request-wide parameters, profile name."""

    strategy: BlendStrategy
    params: AdaptiveParams = ADAPTIVE
    profile: str = ""
    note: str = ""  # why the profile gives no weight here, when that is the request's text


class _Once:
    """A function of no arguments, called the first time and remembered after: one per
    request (`functools.cache` builds an LRU wrapper with `update_wrapper`, about ten
    times the cost, for a single value)."""

    __slots__ = ("_make", "_value")

    def __init__(self, make: Callable[[], Blend]) -> None:
        self._make: Callable[[], Blend] | None = make
        self._value: Blend | None = None

    def __call__(self) -> Blend:
        if self._make is not None:
            self._value, self._make = self._make(), None
        assert self._value is not None
        return self._value


class BlendResolver:
    """Turns a requested strategy into the `Blend` for the served backend and model."""

    def __init__(self, profiles: BlendProfiles) -> None:
        self.profiles = profiles
        self._unprofiled: set[tuple[str, str]] = set()  # (backend, model) already logged

    def resolve(
        self, strategy: BlendStrategy, backend: str, model: str, script: Callable[[], str] = str
    ) -> Blend:
        """`PROFILE` becomes the profile matching backend and model, or the built-in
        adaptive blend when none matches (or the model is not known yet). A profile whose
        model does not read the request's `script` gives it no weight."""
        if strategy is not BlendStrategy.PROFILE:
            return Blend(strategy)
        profile = self.profiles.find(backend, model)
        if profile is not None:
            if profile.scripts and not profile.reads(written := script()):  # ask once
                return Blend(
                    strategy,
                    NO_WEIGHT,
                    profile.name,
                    f" on text in {written} script (its model reads {', '.join(profile.scripts)})",
                )
            return Blend(strategy, profile.params, profile.name)
        if (backend, model) not in self._unprofiled:
            self._unprofiled.add((backend, model))
            log.info(
                "no_blend_profile",
                backend=backend,
                model=model,
                profiles=self.profiles.source,
                using=BlendStrategy.ADAPTIVE.value,
            )
        return Blend(BlendStrategy.ADAPTIVE)

    def settle(
        self,
        strategy: BlendStrategy,
        backend: Callable[[], str],
        model: Callable[[], str],
        script: Callable[[], str] = str,
    ) -> Callable[[], Blend]:
        """The request's blend, resolved on first call and the same on every later one;
        `script` is asked only of a profile that names scripts."""
        return _Once(lambda: self.resolve(strategy, backend(), model(), script))


def load(path: str | Path | None = None) -> BlendProfiles:
    """Profiles from `path`, or the shipped ones when it is empty or None.

    Raises `ConfigError` naming the file, the profile and the field at fault.
    """
    if not path:
        source = f"(shipped) {SHIPPED}"
        text = resources.files(__package__ or "rerank_server.ranking").joinpath(SHIPPED).read_text()
    else:
        source = str(path)
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"{_OPTION}: cannot read {source}: {exc.strerror}") from None
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{_OPTION}: {source} is not JSON: {exc}") from None
    return parse(document, source)


def parse(document: Any, source: str) -> BlendProfiles:
    if not isinstance(document, dict) or not isinstance(document.get("profiles"), list):
        raise ConfigError(f'{_OPTION}: {source}: expected an object with a "profiles" list')
    profiles: list[BlendProfile] = []
    for i, entry in enumerate(document["profiles"]):
        where = f"{_OPTION}: {source}: profiles[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: expected an object")
        text_fields = {}
        for key in ("name", "backend", "model"):
            value = entry.get(key)
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{where}.{key}: a non-empty string is required")
            text_fields[key] = value
        numbers = {}
        for key in _PARAMS:
            value = entry.get(key, getattr(AdaptiveParams(), key))
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"{where}.{key}: a number is required")
            numbers[key] = float(value)
        try:
            params = AdaptiveParams(**numbers)
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        scripts = entry.get("scripts", [])
        if not isinstance(scripts, list) or not all(isinstance(x, str) and x for x in scripts):
            raise ConfigError(
                f'{where}.scripts: a list of script names is required (e.g. ["Latin"])'
            )
        unknown = set(entry) - {"name", "backend", "model", "fitted", "scripts", *_PARAMS}
        if unknown:
            raise ConfigError(f"{where}: unknown field {sorted(unknown)[0]!r}")
        fitted = entry.get("fitted", {})
        if not isinstance(fitted, dict):
            raise ConfigError(f"{where}.fitted: expected an object")
        if any(p.name == text_fields["name"] for p in profiles):
            raise ConfigError(f"{where}.name: {text_fields['name']!r} is used twice")
        profiles.append(
            BlendProfile(params=params, fitted=fitted, scripts=tuple(scripts), **text_fields)
        )
    return BlendProfiles(tuple(profiles), source)
