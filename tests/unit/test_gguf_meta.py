"""A GGUF's metadata, read by `managed/gguf_meta.py` from files written here byte by byte
(the layout in ggml's docs/gguf.md), and what makes one a reranker."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import pytest

from rerank_server.managed.gguf_meta import (
    MAX_KEPT_ARRAY,
    RANK_POOLING,
    GgufError,
    read,
    reranker_kind,
)


def _string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def _value(value: Any) -> bytes:
    if isinstance(value, bool):
        return struct.pack("<I?", 7, value)
    if isinstance(value, int):
        return struct.pack("<II", 4, value)
    if isinstance(value, float):
        return struct.pack("<If", 6, value)
    if isinstance(value, str):
        return struct.pack("<I", 8) + _string(value)
    assert isinstance(value, list)
    if value and isinstance(value[0], str):
        return struct.pack("<IIQ", 9, 8, len(value)) + b"".join(_string(v) for v in value)
    return struct.pack("<IIQ", 9, 4, len(value)) + b"".join(struct.pack("<I", v) for v in value)


def gguf(path: Path, meta: dict[str, Any], version: int = 3) -> Path:
    body = b"".join(_string(k) + _value(v) for k, v in meta.items())
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", version, 0, len(meta)) + body)
    return path


def test_scalars_strings_and_short_arrays_are_read_long_arrays_skipped(tmp_path: Path) -> None:
    vocabulary = [f"token{i}" for i in range(10_000)]
    meta = read(
        gguf(
            tmp_path / "m.gguf",
            {
                "general.architecture": "qwen3",
                "qwen3.block_count": 28,
                "f": 0.5,
                "b": True,
                "tokenizer.ggml.tokens": vocabulary,
                "labels": ["yes", "no"],
                "ids": list(range(MAX_KEPT_ARRAY + 1)),
                "after": "still read",
            },
        )
    )
    assert meta["general.architecture"] == "qwen3" and meta["qwen3.block_count"] == 28
    assert meta["f"] == 0.5 and meta["b"] is True and meta["labels"] == ["yes", "no"]
    assert meta["tokenizer.ggml.tokens"] is None and meta["ids"] is None
    assert meta["after"] == "still read"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"GGML", "not a GGUF file"),
        (b"GGUF" + struct.pack("<IQQ", 9, 0, 0), "version 9"),
        (b"GGUF" + struct.pack("<IQQ", 3, 0, 10**9), "metadata keys"),
        (
            b"GGUF"
            + struct.pack("<IQQ", 3, 0, 1)
            + _string("k")
            + struct.pack("<I", 8)
            + struct.pack("<Q", 100)
            + b"short",
            "ends inside a string",
        ),
        (b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + _string("k") + _value(1), "ends inside"),
        (
            b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _string("k") + struct.pack("<I", 99),
            "unknown value type",
        ),
    ],
)
def test_a_broken_file_is_refused_by_name(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(GgufError, match=message):
        read(path)


def test_rerankers_are_told_from_chat_models(tmp_path: Path) -> None:
    rank = read(
        gguf(
            tmp_path / "r.gguf",
            {"general.architecture": "qwen3", "qwen3.pooling_type": RANK_POOLING},
        )
    )
    kind = reranker_kind(rank)
    assert kind is not None and kind.rank_head
    prompted = read(
        gguf(
            tmp_path / "p.gguf",
            {
                "general.architecture": "qwen3",
                "tokenizer.chat_template": (
                    'Judge ... "yes" or "no". <Query>: {query}\n<Document>: {document}'
                ),
            },
        )
    )
    kind = reranker_kind(prompted)
    assert kind is not None and not kind.rank_head
    named = read(
        gguf(
            tmp_path / "n.gguf",
            {"general.architecture": "qwen3", "general.name": "Qwen3-Reranker-4B"},
        )
    )
    assert reranker_kind(named) is not None
    chat = read(
        gguf(
            tmp_path / "c.gguf",
            {
                "general.architecture": "llama",
                "general.name": "SmolLM2-135M-Instruct",
                "tokenizer.chat_template": "{% for message in messages %}...",
            },
        )
    )
    assert reranker_kind(chat) is None
