"""Which models a server serves and with which settings (`model_specs.plan`): the
flags, `RERANK_MODELS` and the models file, and a clear error for each mistake."""

from __future__ import annotations

from pathlib import Path

import pytest

from rerank_server import settings
from rerank_server.domain import BackendKind
from rerank_server.errors import ConfigError
from rerank_server.model_specs import plan
from rerank_server.settings import ManagedBackend


def load(*argv: str, **environ: str) -> settings.Settings:
    return settings.load(list(argv), environ=environ)


def test_model_flags_and_the_variable() -> None:
    given = plan(load("--model", "en=hf:org/repo/m.gguf", "--model", "ce=http://a:1,http://b:2"))
    assert [(m.name, m.kind) for m in given.models] == [("en", "hub"), ("ce", "urls")]
    en, ce = (m.settings(load()) for m in given.models)
    assert en.managed and en.model_path == "hf:org/repo/m.gguf"
    assert not ce.managed and ce.backend_urls == ["http://a:1", "http://b:2"]
    from_env = plan(load(RERANK_MODELS="a=/m/a.gguf  b=/m/b.gguf"))
    assert [m.name for m in from_env.models] == ["a", "b"]
    # A YAML block scalar (`|` or `>`) ends the variable with a newline, or puts one
    # between entries: whitespace all the same.
    for block in ("a=/m/a.gguf b=/m/b.gguf\n", "a=/m/a.gguf\nb=/m/b.gguf\n"):
        specs = plan(load(RERANK_MODELS=block)).models
        assert [(m.name, m.source) for m in specs] == [("a", "/m/a.gguf"), ("b", "/m/b.gguf")]
    flags_win = plan(load("--model", "c=/m/c.gguf", RERANK_MODELS="a=/m/a.gguf"))
    assert [m.name for m in flags_win.models] == ["c"]


def test_a_plain_model_name_keeps_its_meaning() -> None:
    loaded = load("--model", "qwen3-reranker")
    assert loaded.model == "qwen3-reranker" and not plan(loaded).named
    assert load(RERANK_MODEL="x").model == "x"
    with pytest.raises(ConfigError, match="2 plain names"):
        load("--model", "a", "--model", "b")


def test_the_models_file_sets_each_models_own_settings(tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    path.write_text(
        'default = "big"\n'
        '[models.small]\nsource = "/m/small.gguf"\naliases = ["rerank-v3.5"]\n'
        'concurrency = 2\nmanaged-backend = "rerank"\ninstruction = "find recipes"\n'
        "[models.big]\nllama_slots = 8\n"
    )
    given = plan(load("--models-file", str(path), "--model", "big=/m/big.gguf"))
    assert given.default == "big"
    small, big = given.models
    assert small.aliases == ("rerank-v3.5",)
    own = small.settings(load())
    assert own.concurrency == 2 and own.managed_backend is ManagedBackend.RERANK
    assert own.instruction == "find recipes"
    assert big.source == "/m/big.gguf" and big.settings(load()).llama_slots == 8


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[models.a]\nsource = "/a.gguf"\nport = 1\n', "port: not a per-model setting"),
        ('[models.a]\nsource = "/a.gguf"\nconcurrency = "two"\n', "cannot read 'two' as int"),
        ('[models.a]\nsource = "/a.gguf"\nconcurrency = 2.5\n', "expected int"),
        ('[models.a]\nsource = "/a.gguf"\nconcurrency = 0\n', "model 'a': --concurrency"),
        ('[models.a]\nsource = "/a.gguf"\nbackend = "nope"\n', "choose from"),
        ("[models.a]\nconcurrency = 2\n", "model 'a' has no source"),
        ('[models.a]\nsource = "/a.gguf"\naliases = ["b"]\n[models.b]\nsource = "/b"\n', "twice"),
        ('default = "c"\n[models.a]\nsource = "/a.gguf"\n', "'c' is not a served model"),
        ("colour = 1\n", "unknown keys colour"),
        ("[models\n", "not TOML"),
        ('[models."a b"]\nsource = "/a"\n', "not a model name"),
    ],
)
def test_a_mistake_in_the_models_file_is_named(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "models.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        given = plan(load("--models-file", str(path)))
        for spec in given.models:
            spec.settings(load())


def test_mistakes_in_flags_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is not NAME=SOURCE"):
        plan(load(RERANK_MODELS="a="))
    with pytest.raises(ConfigError, match="no models are named"):
        plan(load("--default-model", "a"))
    with pytest.raises(ConfigError, match="use --workers 1"):
        plan(load("--model", "a=/a.gguf", "--workers", "2"))
    with pytest.raises(ConfigError, match="cannot read it"):
        plan(load("--models-file", str(tmp_path / "missing.toml")))


def test_a_url_source_keeps_the_servers_backend_unless_its_own_is_set(tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    path.write_text('[models.e]\nsource = "http://e:1"\nbackend = "embedding"\n')
    [spec] = plan(load("--models-file", str(path), "--backend", "completion")).models
    assert spec.settings(load("--backend", "completion")).backend is BackendKind.EMBEDDING


def test_a_models_own_backend_wins_and_server_wide_settings_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    path.write_text('[models.e]\nsource = "/m/e.gguf"\nbackend = "embedding"\n')
    [spec] = plan(load("--models-file", str(path), "--managed", "--backend", "chat")).models
    own = spec.settings(load("--managed", "--backend", "chat"))
    assert own.managed_backend is ManagedBackend.EMBEDDING
    path.write_text('[models.e]\nsource = "/m/e.gguf"\nhttp-blend-strategy = "profile"\n')
    with pytest.raises(ConfigError, match="not a per-model setting"):
        plan(load("--models-file", str(path)))
    path.write_text('[models.e]\nsource = "/m/e.gguf"\nbackend-api-key = 7\n')
    with pytest.raises(ConfigError, match="got a value") as refused:
        plan(load("--models-file", str(path)))
    assert "7" not in str(refused.value).split("got")[-1]


def test_a_source_path_may_hold_spaces() -> None:
    [spec] = plan(load("--model", "x=/models/my models/m.gguf")).models
    assert spec.source == "/models/my models/m.gguf"


def test_an_unknown_name_is_repeated_only_when_it_could_be_one() -> None:
    from rerank_server.ranking.served_models import UnknownModel

    assert "'rerank-v3.5'" in str(UnknownModel("rerank-v3.5", ["en"]))
    hostile = "x" * 5000 + "\n<script>"
    said = str(UnknownModel(hostile, ["en"]))
    assert "of 5009 characters" in said and "script" not in said and len(said) < 100
