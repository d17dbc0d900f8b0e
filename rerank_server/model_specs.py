"""The models a server serves and the settings each is served with: `--model NAME=SOURCE`
(repeatable), `RERANK_MODELS`, and the models file (docs/models.md)."""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .ranking.served_models import NAME
from .settings import (
    FLAG_ENTRY_END,
    Settings,
    env_name,
    managed_path_of,
    read_value,
    setting_type,
)

HUB_PREFIX = "hf:"
# What a model may set for itself in the models file; everything else is the server's
# (ports, limits, security, the cache, telemetry).
PER_MODEL_GROUPS = frozenset({"backend", "ranking", "shaping"})
# Of those, what only the server as a whole reads (the JSON API's default blend, the
# edges' check of a request's lists) or what the source sets (a model's backend URL).
NOT_PER_MODEL = frozenset({"http_blend_strategy", "max_lists", "backend_url"})
PER_MODEL_MANAGED = frozenset(
    {
        "llama_server",
        "llama_slots",
        "llama_ctx_per_slot",
        "llama_args",
        "llama_ready_timeout_s",
        "managed_backend",
    }
)
FILE_KEYS = frozenset({"source", "aliases"})


@dataclass(frozen=True)
class ModelSpec:
    """One served model: its name ("" for the server's one unnamed model), where it
    comes from, other names it answers to, and its own settings."""

    name: str
    source: str = ""
    aliases: tuple[str, ...] = ()
    overrides: Mapping[str, Any] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        """`urls` (a running backend), `hub`, `file` (a GGUF), or `settings` (none given:
        the server's own --backend-url / --managed settings)."""
        if not self.source:
            return "settings"
        if self.source.startswith(("http://", "https://")):
            return "urls"
        return "hub" if self.source.startswith(HUB_PREFIX) else "file"

    def settings(self, base: Settings) -> Settings:
        """`base` with this model's source and settings applied."""
        changes: dict[str, Any] = dict(self.overrides)
        own = changes.get("backend")
        # A model's own backend wins over its file's metadata and the server's --backend,
        # as an explicit --backend does (settings.py).
        chosen = managed_path_of(own) if own is not None else None
        if chosen is not None and "managed_backend" not in changes:
            changes["managed_backend"] = chosen
        if self.kind == "urls":
            changes.update(backend_url=self.source, managed=False)
        elif self.kind in ("hub", "file"):
            # A GGUF needs a llama-server to serve it: managed, whatever --managed says.
            path = self.source if self.kind == "hub" else str(Path(self.source).expanduser())
            changes.update(model_path=path, managed=True)
        try:
            return dataclasses.replace(base, **changes)
        except ConfigError as exc:
            raise ConfigError(f"model {self.name!r}: {exc}") from None


@dataclass(frozen=True)
class ModelPlan:
    """Every served model, in order, and the operator's default ("" when none named)."""

    models: tuple[ModelSpec, ...]
    default: str = ""

    @property
    def named(self) -> bool:
        return any(m.name for m in self.models)


def plan(settings: Settings) -> ModelPlan:
    """The models `settings` asks for: the models file's, then `--models` /
    `RERANK_MODELS` entries (an entry naming a model of the file gives it its source);
    none given: the one model of the server's own settings, unnamed."""
    specs: dict[str, ModelSpec] = {}
    default = settings.default_model
    if settings.models_file:
        file_specs, file_default = read_file(Path(settings.models_file).expanduser())
        specs.update((s.name, s) for s in file_specs)
        default = default or file_default
    for name, source in parse_entries(settings.models):
        held = specs.get(name)
        specs[name] = dataclasses.replace(held, source=source) if held else ModelSpec(name, source)
    if not specs:
        if default:
            raise ConfigError(
                f"--default-model / {env_name('default_model')}: no models are named "
                "(--model NAME=SOURCE)"
            )
        return ModelPlan((ModelSpec(""),))
    for spec in specs.values():
        if not spec.source:
            raise ConfigError(
                f"model {spec.name!r} has no source: give one in the models file "
                f"(source = ...) or as --model {spec.name}=SOURCE"
            )
    names = [n for s in specs.values() for n in (s.name, *s.aliases)]
    if dup := sorted({n for n in names if names.count(n) > 1}):
        raise ConfigError(f"models: {', '.join(dup)} named twice (as a name or an alias)")
    if default and default not in names:
        raise ConfigError(
            f"--default-model / {env_name('default_model')}: {default!r} is not a served "
            f"model ({', '.join(specs)})"
        )
    if settings.workers > 1:
        raise ConfigError(
            "--workers / RERANK_WORKERS: serving models by name (--model NAME=SOURCE) "
            "runs in one process; use --workers 1"
        )
    return ModelPlan(tuple(specs.values()), default)


def parse_entries(raw: str) -> list[tuple[str, str]]:
    """`NAME=SOURCE` entries, separated by whitespace (`--models`, `RERANK_MODELS`), or
    each ended by `FLAG_ENTRY_END` (every `--model NAME=SOURCE` lands here so: a path
    given as a flag may hold spaces)."""
    out: list[tuple[str, str]] = []
    entries = raw.split(FLAG_ENTRY_END) if FLAG_ENTRY_END in raw else raw.split()
    for entry in (e.strip() for e in entries):
        if not entry:
            continue
        name, sep, source = entry.partition("=")
        if not sep or not source:
            raise ConfigError(
                f"--model / {env_name('models')}: {entry!r} is not NAME=SOURCE (SOURCE: a "
                "GGUF file, hf:ORG/REPO[/FILE.gguf], or backend URLs)"
            )
        out.append((check_name(name, "--model"), source))
    return out


def check_name(name: str, where: str) -> str:
    if not NAME.fullmatch(name):
        raise ConfigError(
            f"{where}: {name!r} is not a model name (letters, digits and ._:/@+-, "
            "starting with a letter or digit, at most 128)"
        )
    return name


def read_file(path: Path) -> tuple[list[ModelSpec], str]:
    """The models file: a TOML table per model under `models`, and an optional
    `default`. Keys of a model: `source`, `aliases`, and the per-model settings by their
    setting's name (`concurrency`, `managed-backend`, ...)."""
    where = f"--models-file {path}"
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read it ({exc.strerror})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: not TOML ({exc})") from None
    if unknown := set(data) - {"models", "default"}:
        raise ConfigError(f"{where}: unknown keys {', '.join(sorted(unknown))}")
    default = data.get("default", "")
    tables = data.get("models", {})
    if not isinstance(default, str) or not isinstance(tables, dict):
        raise ConfigError(f"{where}: `default` is a name and `models` a table of models")
    specs = []
    for name, table in tables.items():
        check_name(name, f"{where}: models")
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: models.{name} is not a table")
        specs.append(_spec(name, table, f"{where}: models.{name}"))
    return specs, default


def _spec(name: str, table: dict[str, Any], where: str) -> ModelSpec:
    source = table.get("source", "")
    aliases = table.get("aliases", [])
    if not isinstance(source, str):
        raise ConfigError(f"{where}.source: a string")
    if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
        raise ConfigError(f"{where}.aliases: a list of names")
    for alias in aliases:
        check_name(alias, f"{where}.aliases")
    overrides = {}
    for key, value in table.items():
        if key in FILE_KEYS:
            continue
        setting = key.replace("-", "_")
        overrides[setting] = _per_model(setting, value, f"{where}.{key}")
    return ModelSpec(name, source, tuple(aliases), overrides)


def _per_model_setting(name: str, group: str) -> bool:
    return (group in PER_MODEL_GROUPS and name not in NOT_PER_MODEL) or name in PER_MODEL_MANAGED


def _per_model(setting: str, value: Any, where: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(Settings)}
    f = fields.get(setting)
    if f is None or not _per_model_setting(setting, f.metadata["group"]):
        allowed = sorted(n for n, g in fields.items() if _per_model_setting(n, g.metadata["group"]))
        raise ConfigError(
            f"{where}: not a per-model setting; a model may set source, aliases, "
            + ", ".join(a.replace("_", "-") for a in allowed)
        )
    kind = setting_type(setting)
    shown = "a value" if "key" in setting else repr(value)  # an API key is not echoed
    if isinstance(value, bool) != (kind is bool):
        raise ConfigError(f"{where}: expected {kind.__name__}, got {shown}")
    if kind in (int, float) and isinstance(value, int | float):
        if kind is int and isinstance(value, float):
            raise ConfigError(f"{where}: expected int, got {shown}")
        return kind(value)
    if kind is bool:
        return value
    if not isinstance(value, str):
        raise ConfigError(f"{where}: expected {kind.__name__}, got {shown}")
    return read_value(setting, value, where)
