"""Managed mode's choice of scoring path by the model (`start._scoring_path`):
a reranker GGUF gets the path measured fastest, any other model `--backend`, and the
operator's `--managed-backend` wins."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import structlog

from rerank_server.domain import BackendKind
from rerank_server.managed.gguf_meta import RANK_POOLING
from rerank_server.managed.start import _scoring_path
from rerank_server.settings import ManagedBackend, Settings
from tests.unit.test_gguf_meta import gguf

RANK = {"general.architecture": "qwen3", "qwen3.pooling_type": RANK_POOLING}
CHAT = {"general.architecture": "llama", "general.name": "SmolLM2-135M-Instruct"}


def choose(model: Path, **settings: object) -> tuple[BackendKind, list[str], str]:
    base = Settings(managed=True, model_path=str(model))
    with structlog.testing.capture_logs() as logged:
        backend, args = _scoring_path(dataclasses.replace(base, **settings), model)  # type: ignore[arg-type]
    [line] = [e for e in logged if e["event"] == "managed_backend"]
    assert line["backend"] == backend.value and line["model"] == model.name
    return backend, args, line["reason"]


def test_a_reranker_gguf_is_scored_by_the_fastest_measured_path(tmp_path: Path) -> None:
    backend, args, why = choose(gguf(tmp_path / "qwen3-reranker.gguf", RANK))
    assert backend is BackendKind.COMPLETION and args == []
    assert "pooling_type is rank" in why and "2.2x faster" in why


def test_any_other_model_keeps_the_configured_backend(tmp_path: Path) -> None:
    assert choose(gguf(tmp_path / "chat.gguf", CHAT))[:2] == (BackendKind.CHAT, [])
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf")
    backend, _, why = choose(broken, backend=BackendKind.COMPLETION)
    assert backend is BackendKind.COMPLETION and "could not be read" in why


def test_the_operator_chooses_the_path(tmp_path: Path) -> None:
    model = gguf(tmp_path / "qwen3-reranker.gguf", RANK)
    assert choose(model, managed_backend=ManagedBackend.RERANK)[:2] == (
        BackendKind.RERANK,
        ["--rerank"],
    )
    assert choose(model, managed_backend=ManagedBackend.CHAT)[:2] == (BackendKind.CHAT, [])


def test_the_stand_in_keeps_the_configured_backend() -> None:
    base = Settings(managed=True)
    backend, args = _scoring_path(base, Path("SmolLM2-135M-Instruct.Q4_1.gguf"))
    assert (backend, args) == (BackendKind.CHAT, [])
