"""Managed mode's choice of scoring path by the model (`start._scoring_path`, over
`managed/scoring_path.py`), on GGUFs written here byte by byte: a cross-encoder goes to
`rerank`, an embedding model to `embedding`, a Qwen3-style reranker to `completion` only
where its yes/no head is its tied embeddings (else `rerank`), anything else to
`--backend`; the operator's choice wins."""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from rerank_server import settings as settings_module
from rerank_server.domain import BackendKind
from rerank_server.managed.gguf_meta import RANK_POOLING, read_header
from rerank_server.managed.scoring_path import ScoringPath
from rerank_server.managed.start import _scoring_path
from rerank_server.settings import ManagedBackend, Settings
from tests.unit.test_gguf_meta import _string, _value

F32, F16, Q8_0 = 0, 1, 8
VOCAB = ["<pad>", "the", "yes", "cat", "no", "dog"]  # "yes" is 2, "no" 4
WIDTH = 64


def q8_0(rows: np.ndarray) -> bytes:
    """`rows` as ggml's q8_0: blocks of 32 values, an f16 scale then 32 int8."""
    out = bytearray()
    for block in rows.reshape(-1, 32):
        scale = float(np.abs(block).max()) / 127 or 1.0
        out += np.float16(scale).tobytes()
        out += np.round(block / scale).astype(np.int8).tobytes()
    return bytes(out)


def write_gguf(path: Path, meta: dict[str, Any], tensors: dict[str, tuple[int, Any]]) -> Path:
    """A GGUF with `meta` and 2-D `tensors` (name: (ggml type, rows x width array))."""
    body = b"".join(_string(k) + _value(v) for k, v in meta.items())
    infos, data = b"", b""
    for name, (kind, rows) in tensors.items():
        raw = {F32: rows.astype(np.float32).tobytes(), F16: rows.astype(np.float16).tobytes()}
        blob = q8_0(rows) if kind == Q8_0 else raw[kind]
        data += b"\0" * (-len(data) % 32)
        infos += _string(name) + struct.pack(
            "<IQQIQ", 2, rows.shape[1], rows.shape[0], kind, len(data)
        )
        data += blob
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(meta)) + body + infos
    path.write_bytes(head + b"\0" * (-len(head) % 32) + data)
    return path


def qwen3_reranker(path: Path, tied: bool, embd_type: int = Q8_0) -> Path:
    """A Qwen3-Reranker as llama.cpp's converter writes one: rank pooling, `cls.output`
    the LM head's yes/no rows, no `output.weight`; tied: those rows are the embeddings'."""
    rng = np.random.default_rng(0)
    embd = rng.normal(size=(len(VOCAB), WIDTH)).astype(np.float32)
    head = embd[[2, 4]] if tied else rng.normal(size=(2, WIDTH)).astype(np.float32)
    meta = {
        "general.architecture": "qwen3",
        "qwen3.pooling_type": RANK_POOLING,
        "tokenizer.ggml.tokens": VOCAB,
    }
    return write_gguf(
        path, meta, {"token_embd.weight": (embd_type, embd), "cls.output.weight": (F32, head)}
    )


BERT = {"general.architecture": "bert", "bert.attention.causal": False, "bert.context_length": 512}


def choose(model: Path, **settings: object) -> tuple[ScoringPath, str]:
    base = Settings(managed=True, model_path=str(model))
    with structlog.testing.capture_logs() as logged:
        path = _scoring_path(dataclasses.replace(base, **settings), model)  # type: ignore[arg-type]
    [line] = [e for e in logged if e["event"] == "managed_backend"]
    assert line["backend"] == path.backend.value and line["model"] == model.name
    return path, line["reason"]


def test_a_cross_encoder_with_a_classification_head_is_scored_by_rerank(tmp_path: Path) -> None:
    """The test suite's own MiniLM with a rank head: no pooling key, `cls.output` tensors."""
    head = np.ones((1, WIDTH), np.float32)
    path, why = choose(write_gguf(tmp_path / "ce.gguf", BERT, {"cls.output.weight": (F32, head)}))
    assert path.backend is BackendKind.RERANK and path.llama_args == ("--rerank",)
    assert path.context_length == 512 and "cross-encoder" in why and "cls.output" in why
    pooled = write_gguf(tmp_path / "bge.gguf", {**BERT, "bert.pooling_type": RANK_POOLING}, {})
    assert choose(pooled)[0].backend is BackendKind.RERANK


def test_an_embedding_model_is_scored_by_cosine(tmp_path: Path) -> None:
    path, why = choose(write_gguf(tmp_path / "minilm.gguf", {**BERT, "bert.pooling_type": 1}, {}))
    assert path.backend is BackendKind.EMBEDDING
    assert path.llama_args == ("--embedding", "--pooling", "mean") and "mean pooling" in why


def test_a_qwen3_reranker_with_tied_embeddings_is_scored_by_completion(tmp_path: Path) -> None:
    """Tied (0.6B): the output layer llama.cpp builds is the embeddings, whose yes/no rows
    are `cls.output`'s, so `completion` reads the model's own logits, and is faster."""
    for kind in (Q8_0, F16, F32):
        path, why = choose(qwen3_reranker(tmp_path / f"tied{kind}.gguf", tied=True, embd_type=kind))
        assert path.backend is BackendKind.COMPLETION and path.llama_args == (), kind
        assert "tied" in why and "2.2x faster" in why


def test_a_qwen3_reranker_with_an_untied_head_is_scored_by_rerank(tmp_path: Path) -> None:
    """Untied (8B): the converter keeps only the yes/no rows, in `cls.output`; the output
    layer llama.cpp builds falls back to the embeddings, whose logits are not the
    model's. Only `--rerank` reads the real head."""
    path, why = choose(qwen3_reranker(tmp_path / "untied.gguf", tied=False))
    assert path.backend is BackendKind.RERANK and path.llama_args == ("--rerank",)
    assert "untied" in why


def test_the_yes_and_no_ids_are_found_in_a_long_vocabulary(tmp_path: Path) -> None:
    vocab = [f"t{i}" for i in range(5_000)] + ["yes"] + ["no"]
    meta = {"general.architecture": "qwen3", "tokenizer.ggml.tokens": vocab}
    header = read_header(write_gguf(tmp_path / "v.gguf", meta, {}))
    assert header.answer_ids == {"yes": 5_000, "no": 5_001}
    assert header.meta["tokenizer.ggml.tokens"] is None  # not kept


def test_a_prompted_reranker_and_a_chat_model(tmp_path: Path) -> None:
    prompted = {
        "general.architecture": "qwen3",
        "tokenizer.chat_template": 'Judge ... "yes" or "no". <Document>: {document}',
    }
    assert (
        choose(write_gguf(tmp_path / "p.gguf", prompted, {}))[0].backend is BackendKind.COMPLETION
    )
    chat = {"general.architecture": "llama", "general.name": "SmolLM2-135M-Instruct"}
    path, why = choose(write_gguf(tmp_path / "chat.gguf", chat, {}))
    assert path.backend is BackendKind.CHAT and "--backend" in why
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf")
    path, why = choose(broken, backend=BackendKind.COMPLETION)
    assert path.backend is BackendKind.COMPLETION and "could not be read" in why


def test_the_operator_chooses_the_path(tmp_path: Path) -> None:
    model = qwen3_reranker(tmp_path / "tied.gguf", tied=True)
    path, why = choose(model, managed_backend=ManagedBackend.RERANK)
    assert (path.backend, path.llama_args) == (BackendKind.RERANK, ("--rerank",))
    assert "operator" in why
    assert choose(model, managed_backend=ManagedBackend.CHAT)[0].backend is BackendKind.CHAT


def test_an_explicit_backend_wins_as_managed_backend_does() -> None:
    """`--backend chat` given (flag or variable) is the operator's choice; the default
    `chat` is not."""
    load = settings_module.load
    assert (
        load(["--managed", "--backend", "chat"], environ={}).managed_backend is ManagedBackend.CHAT
    )
    assert load(["--managed"], environ={"RERANK_BACKEND": "rerank"}).managed_backend is (
        ManagedBackend.RERANK
    )
    assert load(["--managed"], environ={}).managed_backend is ManagedBackend.AUTO
    both = load(["--backend", "chat", "--managed-backend", "rerank"], environ={})
    assert both.managed_backend is ManagedBackend.RERANK


def test_a_causal_embedding_model_and_an_old_encoder_file(tmp_path: Path) -> None:
    """Qwen3-Embedding (causal, last pooling) is scored by cosine; a BERT file written
    before the `attention.causal` key is still an encoder."""
    qwen = {"general.architecture": "qwen3", "qwen3.pooling_type": 3}
    path, why = choose(write_gguf(tmp_path / "qe.gguf", qwen, {}))
    assert "causal" in why
    assert path.backend is BackendKind.EMBEDDING and path.llama_args[-1] == "last"
    old = {"general.architecture": "bert", "bert.pooling_type": 1}
    assert choose(write_gguf(tmp_path / "old.gguf", old, {}))[0].backend is BackendKind.EMBEDDING
    head = np.ones((1, WIDTH), np.float32)
    old_ce = write_gguf(
        tmp_path / "old-ce.gguf",
        {"general.architecture": "bert"},
        {"cls.output.weight": (F32, head)},
    )
    assert choose(old_ce)[0].backend is BackendKind.RERANK
