"""Which backend scores a GGUF, read from the file: a cross-encoder by `rerank`, an
embedding model by `embedding`, a causal-LM reranker by `completion`, anything else by
the configured backend. The rules and the measurements behind them: docs/backends.md."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np

from ..domain import BackendKind
from .gguf_meta import RANK_POOLING, Gguf, GgufError, read_header, reranker_kind

# llama.cpp's pooling types (LLAMA_POOLING_TYPE_*): what an embedding model pools by.
POOLING_NAMES = {1: "mean", 2: "cls", 3: "last"}
# Encoders, for files without the `attention.causal` key (llama.cpp's names).
ENCODERS = frozenset(
    {
        "bert",
        "nomic-bert",
        "nomic-bert-moe",
        "jina-bert-v2",
        "jina-bert-v3",
        "modern-bert",
        "neo-bert",
        "eurobert",
        "gemma-embedding",
        "t5encoder",
    }
)
# ggml types whose rows this module can read to compare two heads.
F32, F16, Q8_0, BF16 = 0, 1, 8, 30
Q8_0_BLOCK = 32
# Rows that are the same weights, stored in two types, agree to about 1e-3 (q8_0); an
# untied head's rows are unrelated to the embeddings' (cosine near 0).
SAME_ROWS_COSINE = 0.999

COMPLETION_WHY = (
    "completion: prompt arrays, each slot reusing the prompt prefix the request's "
    "passages share, scored 40 passages 2.2x faster than llama-server --rerank on the CPU"
)


@dataclass(frozen=True)
class ScoringPath:
    """A backend for the model, why, and the arguments llama-server needs for it."""

    backend: BackendKind
    why: str
    llama_args: tuple[str, ...] = ()
    # An encoder reads at most this many tokens a sequence (its position table).
    context_length: int | None = None


def choose(gguf: Gguf) -> ScoringPath | None:
    """The path the file's own metadata and tensors call for; None: not a model this
    server can score without being told how (a chat model: the configured backend)."""
    arch = gguf.architecture
    meta = gguf.meta
    pooling = meta.get(f"{arch}.pooling_type")
    causal = meta.get(f"{arch}.attention.causal", arch not in ENCODERS) is not False
    head = next((n for n in ("cls.output.weight", "cls.weight") if n in gguf.tensors), None)
    ctx = meta.get(f"{arch}.context_length")
    ctx = ctx if isinstance(ctx, int) and ctx > 0 else None
    if not causal and (pooling == RANK_POOLING or head is not None):
        what = "rank pooling" if pooling == RANK_POOLING else f"a classification head ({head})"
        return ScoringPath(
            BackendKind.RERANK,
            f"a cross-encoder ({arch}, {what}): llama-server --rerank",
            ("--rerank",),
            ctx,
        )
    if not causal and pooling in POOLING_NAMES:
        name = POOLING_NAMES[pooling]
        return ScoringPath(
            BackendKind.EMBEDDING,
            f"an embedding model ({arch}, {name} pooling): cosine of query and passage",
            ("--embedding", "--pooling", name),
            ctx,
        )
    if pooling == RANK_POOLING:
        return _causal_rank_head(gguf)
    if pooling in POOLING_NAMES:  # a causal embedding model (Qwen3-Embedding: last)
        name = POOLING_NAMES[pooling]
        return ScoringPath(
            BackendKind.EMBEDDING,
            f"an embedding model ({arch}, causal, {name} pooling): cosine of query and passage",
            ("--embedding", "--pooling", name),
        )
    kind = reranker_kind(meta)
    if kind is not None:
        return ScoringPath(BackendKind.COMPLETION, f"{kind.why}; {COMPLETION_WHY}")
    return None


def _causal_rank_head(gguf: Gguf) -> ScoringPath:
    """A causal LM converted with rank pooling (Qwen3-Reranker): its `cls.output` holds
    the LM head's "yes" and "no" rows, and the converter drops the LM head itself.
    `completion` reads the yes/no logits from the output layer llama.cpp builds, which is
    the token embeddings when the file has no `output.weight`: the model's own head only
    when the two were tied. So `completion` (faster) where the rows are shown to be the
    embeddings' rows, `--rerank` (which reads `cls.output`) otherwise."""
    arch = gguf.architecture
    try:
        tied = "output.weight" not in gguf.tensors and _rows_are_embeddings(gguf)
    except (OSError, GgufError, ValueError) as exc:
        tied, unread = None, f"its head could not be compared ({exc})"
    if tied:
        return ScoringPath(
            BackendKind.COMPLETION,
            f"{arch} with rank pooling whose yes/no rows are its tied embeddings' rows; "
            + COMPLETION_WHY,
        )
    if tied is False:
        unread = "its yes/no head is not the output layer llama.cpp builds (untied)"
    return ScoringPath(
        BackendKind.RERANK,
        f"{arch} with rank pooling; {unread}: llama-server --rerank reads cls.output",
        ("--rerank",),
    )


def _rows_are_embeddings(gguf: Gguf) -> bool:
    """Whether `cls.output`'s two rows are the token embeddings' rows of "yes" and "no"."""
    cls, embd = gguf.tensors.get("cls.output.weight"), gguf.tensors.get("token_embd.weight")
    yes, no = gguf.answer_ids.get("yes"), gguf.answer_ids.get("no")
    if cls is None or embd is None or yes is None or no is None:
        raise GgufError("cls.output, token_embd or the yes/no tokens are missing")
    if cls.shape[0] != embd.shape[0] or cls.shape[1:] != (2,):
        raise GgufError(f"cls.output is {cls.shape}, token_embd {embd.shape}")
    with gguf.path.open("rb") as f:
        heads = [_row(f, cls.offset, cls.ggml_type, cls.shape[0], i) for i in (0, 1)]
        embeds = [_row(f, embd.offset, embd.ggml_type, embd.shape[0], i) for i in (yes, no)]
    return all(_cosine(a, b) >= SAME_ROWS_COSINE for a, b in zip(heads, embeds, strict=True))


def _row(f: IO[bytes], offset: int, ggml_type: int, width: int, index: int) -> np.ndarray:
    """Row `index` of a 2-D tensor as float32 (f32, f16, bf16 and q8_0 rows)."""
    if ggml_type == Q8_0:
        if width % Q8_0_BLOCK:
            raise GgufError(f"a q8_0 row of {width}")
        blocks = width // Q8_0_BLOCK
        f.seek(offset + index * blocks * 34)
        raw = np.frombuffer(_exactly(f, blocks * 34), np.uint8).reshape(blocks, 34)
        scales = raw[:, :2].copy().view(np.float16).astype(np.float32)
        values = raw[:, 2:].copy().view(np.int8).astype(np.float32)
        return (values * scales).reshape(-1)
    sizes = {F32: 4, F16: 2, BF16: 2}
    if ggml_type not in sizes:
        raise GgufError(f"ggml type {ggml_type} is not read here")
    f.seek(offset + index * width * sizes[ggml_type])
    data = _exactly(f, width * sizes[ggml_type])
    if ggml_type == F32:
        return np.frombuffer(data, np.float32)
    if ggml_type == F16:
        return np.frombuffer(data, np.float16).astype(np.float32)
    return (np.frombuffer(data, np.uint16).astype(np.uint32) << 16).view(np.float32)


def _exactly(f: IO[bytes], size: int) -> bytes:
    data = f.read(size)
    if len(data) != size:
        raise GgufError("the file ends inside a tensor")
    return data


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    norm = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(np.dot(a, b)) / norm if norm else 0.0


def read_path(path: Path) -> ScoringPath | None:
    """`choose` for the file at `path` (raises OSError or GgufError)."""
    return choose(read_header(path))
