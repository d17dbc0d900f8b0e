"""What a GGUF file says of itself: its header's key/value metadata, without its tensors.

Managed mode reads it to tell a reranker from a chat model (`reranker_kind`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

MAGIC = b"GGUF"
MAX_KEYS = 100_000
MAX_KEPT_ARRAY = 64  # arrays longer than this are skipped (vocabularies, merges)
MAX_KEPT_STRING = 64 * 1024  # a chat template is a few KB; longer strings are cut
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
STRING, ARRAY = 8, 9
RANK_POOLING = 4  # llama.cpp's LLAMA_POOLING_TYPE_RANK


class GgufError(ValueError):
    """Not a GGUF file this reader understands; the message says where it broke."""


@dataclass(frozen=True)
class Reranker:
    """A GGUF made for reranking: `rank_head` when llama-server --rerank can serve it
    (rank pooling), else a causal LM prompted as one (`chat`/`completion` paths)."""

    rank_head: bool
    why: str


def read(path: Path) -> dict[str, Any]:
    """The metadata of the GGUF at `path` (skipped arrays read as None).

    The format (ggml's docs/gguf.md): "GGUF", a version (2 or 3), the tensor and key
    counts, then each key as a length-prefixed UTF-8 string, a value type and the value.
    Arrays are kept only when short (a vocabulary is 150,000 strings), strings up to a
    cap. Nothing here trusts the file: a count or length past what it can hold is an error.
    """
    with path.open("rb") as f:
        if f.read(4) != MAGIC:
            raise GgufError(f"{path}: not a GGUF file")
        version = _unpack(f, "<I")
        if version not in (2, 3):
            raise GgufError(f"{path}: GGUF version {version} is not 2 or 3")
        _unpack(f, "<Q")  # tensors
        count = _unpack(f, "<Q")
        if count > MAX_KEYS:
            raise GgufError(f"{path}: {count} metadata keys")
        out: dict[str, Any] = {}
        for _ in range(count):
            key = _string(f, 1024)
            out[key] = _value(f, _unpack(f, "<I"))
        return out


def reranker_kind(meta: dict[str, Any]) -> Reranker | None:
    """Whether the metadata is a reranker's: rank pooling (what llama.cpp's converter gives
    a Qwen3-Reranker or a cross-encoder), or a chat template made for reranking."""
    arch = meta.get("general.architecture", "")
    if meta.get(f"{arch}.pooling_type") == RANK_POOLING:
        return Reranker(True, f"{arch}.pooling_type is rank")
    template = meta.get("tokenizer.chat_template.rerank") or meta.get("tokenizer.chat_template")
    name = str(meta.get("general.name", ""))
    if isinstance(template, str) and "<Document>" in template and "yes" in template:
        return Reranker(False, "its chat template asks for yes or no on a <Document>")
    if "reranker" in name.lower():
        return Reranker(False, f"general.name is {name!r}")
    return None


def _unpack(f: IO[bytes], fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise GgufError("the file ends inside its metadata")
    return struct.unpack(fmt, data)[0]


def _string(f: IO[bytes], keep: int) -> str:
    length = _unpack(f, "<Q")
    if length > keep:
        kept = f.read(keep)
        f.seek(length - keep, 1)
    else:
        kept = f.read(length)
    if len(kept) != min(length, keep):
        raise GgufError("the file ends inside a string")
    return kept.decode("utf-8", errors="replace")


def _value(f: IO[bytes], kind: int) -> Any:
    if kind in _SCALARS:
        return _unpack(f, _SCALARS[kind])
    if kind == STRING:
        return _string(f, MAX_KEPT_STRING)
    if kind == ARRAY:
        item, length = _unpack(f, "<I"), _unpack(f, "<Q")
        if length <= MAX_KEPT_ARRAY:
            return [_value(f, item) for _ in range(length)]
        if item in _SCALARS:
            f.seek(length * struct.calcsize(_SCALARS[item]), 1)
        elif item == STRING:
            for _ in range(length):
                f.seek(_unpack(f, "<Q"), 1)
        else:
            raise GgufError(f"an array of {length} arrays")
        return None
    raise GgufError(f"unknown value type {kind}")
