"""What a managed llama-server holds in memory: estimated from the GGUF before it starts,
measured once it is ready, and the container's limit they are held against."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .gguf_meta import Gguf
from .scoring_path import ENCODERS

# Bytes an element of the KV cache takes, by llama-server's `--cache-type-k/-v` names
# (ggml block sizes: 32 elements with their scales).
CACHE_TYPE_BYTES = {
    "f32": 4.0,
    "f16": 2.0,
    "bf16": 2.0,
    "q8_0": 34 / 32,
    "q5_1": 24 / 32,
    "q5_0": 22 / 32,
    "q4_1": 20 / 32,
    "q4_0": 18 / 32,
    "iq4_nl": 18 / 32,
}
_CACHE_TYPE_FLAGS = {
    "k": ("-ctk", "--cache-type-k"),
    "v": ("-ctv", "--cache-type-v"),
}
# A cgroup v1 "no limit" is the largest page-aligned signed 64-bit number.
_UNLIMITED = 1 << 60


@dataclass(frozen=True)
class MemoryEstimate:
    """A llama-server's resident memory before compute buffers and its own runtime (tens
    of MB): the model file, mapped and read whole, and the KV cache of every slot.
    `kv_cache_bytes` is None where the metadata does not say (then so is `total_bytes`)."""

    file_bytes: int
    kv_cache_bytes: int | None

    @property
    def total_bytes(self) -> int | None:
        return None if self.kv_cache_bytes is None else self.file_bytes + self.kv_cache_bytes


def estimate(gguf: Gguf, tokens: int, llama_args: Sequence[str]) -> MemoryEstimate:
    """For `tokens` of context in all (slots x ctx-per-slot) and llama-server's arguments."""
    return MemoryEstimate(gguf.path.stat().st_size, kv_cache_bytes(gguf, tokens, llama_args))


def kv_cache_bytes(gguf: Gguf, tokens: int, llama_args: Sequence[str] = ()) -> int | None:
    """The KV cache llama.cpp allocates for `tokens`: per layer, K and V rows of
    `head_count_kv` heads. An encoder has none (it reads each sequence in one batch).
    Sliding-window layers hold less than this; None when a key it needs is missing."""
    arch, meta = gguf.architecture, gguf.meta
    if meta.get(f"{arch}.attention.causal", arch not in ENCODERS) is False:
        return 0
    try:
        layers = int(meta[f"{arch}.block_count"])
        heads = _per_layer(meta[f"{arch}.attention.head_count"], layers)
        kv_heads = _per_layer(meta.get(f"{arch}.attention.head_count_kv", heads), layers)
        width = int(meta[f"{arch}.embedding_length"])
        head_k = meta.get(f"{arch}.attention.key_length")
        head_v = meta.get(f"{arch}.attention.value_length")
    except (KeyError, TypeError, ValueError):
        return None
    k_bytes = CACHE_TYPE_BYTES.get(_cache_type(llama_args, "k"), 2.0)
    v_bytes = CACHE_TYPE_BYTES.get(_cache_type(llama_args, "v"), 2.0)
    row = 0.0
    for h, h_kv in zip(heads, kv_heads, strict=True):
        if not h_kv:
            continue  # a layer without attention (a hybrid model's recurrent one)
        k = int(head_k) if head_k else width // h
        v = int(head_v) if head_v else width // h
        row += h_kv * (k * k_bytes + v * v_bytes)
    return int(tokens * row)


def _per_layer(value: Any, layers: int) -> list[int]:
    """A count given once for all layers, or per layer (an array)."""
    if isinstance(value, list):
        if len(value) != layers:
            raise ValueError("per-layer array of the wrong length")
        return [int(v) for v in value]
    return [int(value)] * layers


def _cache_type(args: Sequence[str], which: str) -> str:
    """The operator's cache type for K or V in llama-server's arguments; f16 otherwise."""
    found = "f16"
    flags = _CACHE_TYPE_FLAGS[which]
    for i, arg in enumerate(args):
        if arg in flags and i + 1 < len(args):
            found = args[i + 1]
        elif arg.startswith(tuple(f"{f}=" for f in flags)):
            found = arg.split("=", 1)[1]
    return found.lower()


def container_limit(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """This process's cgroup memory limit in bytes (v2 `memory.max`, v1
    `memory.limit_in_bytes`); None without one (`max`, or not Linux)."""
    for name in ("memory.max", "memory/memory.limit_in_bytes"):
        try:
            raw = (root / name).read_text().strip()
        except OSError:
            continue
        if raw == "max" or not raw.isdigit():
            return None
        limit = int(raw)
        return None if limit >= _UNLIMITED else limit
    return None


def resident_bytes(pid: int | None) -> int | None:
    """A process's resident memory (VmRSS) in bytes; None where /proc cannot say."""
    if pid is None:
        return None
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return None
