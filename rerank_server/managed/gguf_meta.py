"""What a GGUF file says of itself: its header's metadata and tensor entries.

Managed mode reads it to choose a scoring path (`managed/scoring_path.py`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

MAGIC = b"GGUF"
MAX_KEYS = 100_000
MAX_TENSORS = 1_000_000
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
TOKENS_KEY = "tokenizer.ggml.tokens"
ANSWER_TOKENS = ("yes", "no")  # a Qwen3-Reranker's head: these two rows of its LM head


class GgufError(ValueError):
    """Not a GGUF file this reader understands; the message says where it broke."""


@dataclass(frozen=True)
class Tensor:
    """A tensor's entry in the header: its shape (ggml order, fastest first), its ggml
    type and where its data starts in the file."""

    shape: tuple[int, ...]
    ggml_type: int
    offset: int


@dataclass(frozen=True)
class Gguf:
    """A GGUF's header: metadata, tensor entries, and the ids of "yes" and "no" in its
    vocabulary (the vocabulary itself is not kept)."""

    path: Path
    meta: dict[str, Any]
    tensors: dict[str, Tensor]
    answer_ids: dict[str, int]

    @property
    def architecture(self) -> str:
        return str(self.meta.get("general.architecture", ""))


def read(path: Path) -> dict[str, Any]:
    """The metadata of the GGUF at `path` (skipped arrays read as None)."""
    return read_header(path).meta


def read_header(path: Path) -> Gguf:
    """The header of the GGUF at `path`: metadata, then the tensor entries.

    The format (ggml's docs/gguf.md): "GGUF", a version (2 or 3), the tensor and key
    counts, then each key as a length-prefixed UTF-8 string, a value type and the value;
    then each tensor's name, dimensions, type and offset; the data after that, aligned.
    Arrays are kept only when short (a vocabulary is 150,000 strings), strings up to a
    cap. Nothing here trusts the file: a count or length past what it can hold is an error.
    """
    with path.open("rb") as f:
        if f.read(4) != MAGIC:
            raise GgufError(f"{path}: not a GGUF file")
        version = _unpack(f, "<I")
        if version not in (2, 3):
            raise GgufError(f"{path}: GGUF version {version} is not 2 or 3")
        n_tensors = _unpack(f, "<Q")
        count = _unpack(f, "<Q")
        if count > MAX_KEYS:
            raise GgufError(f"{path}: {count} metadata keys")
        if n_tensors > MAX_TENSORS:
            raise GgufError(f"{path}: {n_tensors} tensors")
        meta: dict[str, Any] = {}
        answers: dict[str, int] = {}
        for _ in range(count):
            key = _string(f, 1024)
            kind = _unpack(f, "<I")
            if key == TOKENS_KEY and kind == ARRAY:
                meta[key] = _vocabulary(f, answers)
            else:
                meta[key] = _value(f, kind)
        entries: list[tuple[str, tuple[int, ...], int, int]] = []
        for _ in range(n_tensors):
            name = _string(f, 1024)
            dims = _unpack(f, "<I")
            if dims > 8:
                raise GgufError(f"{path}: tensor {name} has {dims} dimensions")
            shape = tuple(_unpack(f, "<Q") for _ in range(dims))
            entries.append((name, shape, _unpack(f, "<I"), _unpack(f, "<Q")))
        alignment = meta.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0:
            raise GgufError(f"{path}: general.alignment is {alignment!r}")
        start = -(-f.tell() // alignment) * alignment
    tensors = {name: Tensor(shape, kind, start + at) for name, shape, kind, at in entries}
    return Gguf(path, meta, tensors, answers)


@dataclass(frozen=True)
class Reranker:
    """A GGUF made for reranking: `rank_head` when llama-server --rerank can serve it
    (rank pooling), else a causal LM prompted as one (`chat`/`completion` paths)."""

    rank_head: bool
    why: str


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


def _vocabulary(f: IO[bytes], answers: dict[str, int]) -> list[Any] | None:
    """The tokens array, kept when short; the ids of "yes" and "no" noted either way."""
    item, length = _unpack(f, "<I"), _unpack(f, "<Q")
    if item != STRING:
        raise GgufError(f"{TOKENS_KEY} is an array of type {item}, not of strings")
    kept: list[Any] | None = [] if length <= MAX_KEPT_ARRAY else None
    for i in range(length):
        token = _string(f, 64)
        if token in ANSWER_TOKENS and token not in answers:
            answers[token] = i
        if kept is not None:
            kept.append(token)
    return kept


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
