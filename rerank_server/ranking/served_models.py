"""The models a server serves, each with its own pipeline, and the choice of one by the
name a request gives (`model` in JSON and in gRPC's `RerankRequest`)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from .pipeline import Reranker

# Whether a model's backend can score now: None while it has not been checked yet.
BackendState = Callable[[], bool | None]
# What a served name may be (`--model NAME=SOURCE`), and what of a request's `model` is
# ever repeated back: hub-style names ("BAAI/bge-reranker-v2-m3") fit.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}")


def _never_up() -> bool | None:
    return None


class UnknownModel(LookupError):
    """A request named a model this server does not serve; the message lists those it
    does (names only: never a file path or a backend URL). The name asked for is
    repeated only when it is one a model could have: a request's text is not echoed
    into answers and logs."""

    def __init__(self, asked: str, served: Sequence[str]) -> None:
        said = repr(asked) if NAME.fullmatch(asked) else f"of {len(asked)} characters"
        super().__init__(f"model {said} is not served here; served: {', '.join(served)}")
        self.served = tuple(served)


@dataclass(frozen=True)
class ServedModel:
    """One served model: its name, the names it also answers to, its pipeline, and
    whether its backend is up."""

    name: str
    reranker: Reranker
    backend_up: BackendState = field(default=_never_up)
    aliases: tuple[str, ...] = ()

    @property
    def model(self) -> str:
        """Its name in answers, `/v1/models` and health: the served name, else what the
        backend calls it."""
        return self.reranker.model

    @property
    def kind(self) -> str:
        return self.reranker.scorer.kind


class ServedModels:
    """Routes a request to a model by name.

    One model: any name is accepted (the ecosystem's clients send their own default
    names). Several: a request naming none gets the default (the operator's, else the
    first listed); one naming a served name or alias gets that model; any other name is
    `UnknownModel`, unless the operator named a default, which then takes it.
    """

    def __init__(self, models: Sequence[ServedModel], default: str = "") -> None:
        if not models:
            raise ValueError("no model to serve")
        self.models = tuple(models)
        self._by_name: dict[str, ServedModel] = {}
        for served in self.models:
            for name in (served.name, *served.aliases):
                if name in self._by_name:
                    raise ValueError(f"two models are named {name!r}")
                if name:
                    self._by_name[name] = served
        if default and default not in self._by_name:
            raise ValueError(f"the default model {default!r} is not served")
        self._fallback = self._by_name[default] if default else None
        self.default = self._by_name[default] if default else self.models[0]

    @property
    def names(self) -> list[str]:
        """The served names, in the order they were given (aliases not included)."""
        return [m.model for m in self.models]

    def select(self, name: str | None) -> ServedModel:
        """The model a request asked for by `name` (None or "": the default)."""
        if len(self.models) == 1:
            return self.models[0]
        if not name:
            return self.default
        served = self._by_name.get(name)
        if served is not None:
            return served
        if self._fallback is not None:
            return self._fallback
        raise UnknownModel(name, self.names)

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(self.models)
