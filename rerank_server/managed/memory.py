"""What a managed llama-server holds in memory: estimated from the GGUF before it starts,
measured once it is ready, and the container's limit they are held against."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
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
# llama-server's flags and the variables it reads for them (its `--help`); an argument
# wins over a variable, and the last of an argument given twice wins.
CACHE_TYPE_K = (("-ctk", "--cache-type-k"), "LLAMA_ARG_CACHE_TYPE_K")
CACHE_TYPE_V = (("-ctv", "--cache-type-v"), "LLAMA_ARG_CACHE_TYPE_V")
CTX_SIZE = (("-c", "--ctx-size"), "LLAMA_ARG_CTX_SIZE")
GPU_LAYERS = (("-ngl", "--gpu-layers", "--n-gpu-layers"), "LLAMA_ARG_N_GPU_LAYERS")
# Architectures llama.cpp gives no KV cache (`llama_model::create_memory`): the encoders
# but T5's, and the diffusion models, which read each sequence whole.
NO_KV_CACHE = (ENCODERS - {"t5encoder"}) | {
    "wavtokenizer-dec",
    "dream",
    "llada",
    "llada-moe",
    "rnd1",
    "clef",
}
# A cgroup v1 "no limit" is the largest page-aligned signed 64-bit number.
_UNLIMITED = 1 << 60


@dataclass(frozen=True)
class MemoryEstimate:
    """A llama-server's resident memory before compute buffers and its own runtime (tens
    of MB): the model file, mapped and read whole, and the KV cache for `kv_cache_tokens`.
    `kv_cache_bytes` is None where the metadata does not say (then so is `total_bytes`)."""

    file_bytes: int
    kv_cache_bytes: int | None
    kv_cache_tokens: int

    @property
    def total_bytes(self) -> int | None:
        return None if self.kv_cache_bytes is None else self.file_bytes + self.kv_cache_bytes

    @property
    def at_least_bytes(self) -> int:
        """What it is known to hold: the total, or the file where the KV is unknown."""
        return self.total_bytes or self.file_bytes


def estimate(
    gguf: Gguf, tokens: int, llama_args: Sequence[str], environ: Mapping[str, str] = os.environ
) -> MemoryEstimate:
    """For `tokens` of context in all (slots x ctx-per-slot), unless llama-server's
    arguments or variables set its context otherwise."""
    ctx = setting(llama_args, CTX_SIZE, environ)
    if ctx is not None and ctx.isdigit():
        trained = gguf.meta.get(f"{gguf.architecture}.context_length")
        tokens = int(ctx) if int(ctx) else int(trained) if isinstance(trained, int) else tokens
    return MemoryEstimate(
        gguf.path.stat().st_size, kv_cache_bytes(gguf, tokens, llama_args, environ), tokens
    )


def kv_cache_bytes(
    gguf: Gguf,
    tokens: int,
    llama_args: Sequence[str] = (),
    environ: Mapping[str, str] = os.environ,
) -> int | None:
    """The KV cache llama.cpp allocates for `tokens`: per layer, K and V rows of
    `head_count_kv` heads, each head `key_length`/`value_length` wide (by default the
    width over the first layer's heads, as llama.cpp takes it). Sliding-window layers
    hold less than this; None when a key it needs is missing."""
    arch, meta = gguf.architecture, gguf.meta
    if arch in NO_KV_CACHE:
        return 0
    try:
        layers = int(meta[f"{arch}.block_count"])
        heads = _per_layer(meta[f"{arch}.attention.head_count"], layers)
        kv_heads = _per_layer(meta.get(f"{arch}.attention.head_count_kv", heads), layers)
        width = int(meta[f"{arch}.embedding_length"])
        head_k = int(meta.get(f"{arch}.attention.key_length") or width // heads[0])
        head_v = int(meta.get(f"{arch}.attention.value_length") or width // heads[0])
    except (KeyError, TypeError, ValueError, ZeroDivisionError, IndexError):
        return None
    k_bytes = CACHE_TYPE_BYTES.get(_cache_type(llama_args, CACHE_TYPE_K, environ), 2.0)
    v_bytes = CACHE_TYPE_BYTES.get(_cache_type(llama_args, CACHE_TYPE_V, environ), 2.0)
    # A layer with no KV heads has no attention (a hybrid model's recurrent one).
    row = sum(h_kv * (head_k * k_bytes + head_v * v_bytes) for h_kv in kv_heads)
    return int(tokens * row)


def _per_layer(value: Any, layers: int) -> list[int]:
    """A count given once for all layers, or per layer (an array)."""
    if isinstance(value, list):
        if len(value) != layers or not value:
            raise ValueError("per-layer array of the wrong length")
        return [int(v) for v in value]
    return [int(value)] * layers


def _cache_type(
    args: Sequence[str], option: tuple[tuple[str, ...], str], environ: Mapping[str, str]
) -> str:
    return (setting(args, option, environ) or "f16").lower()


def setting(
    args: Sequence[str],
    option: tuple[tuple[str, ...], str],
    environ: Mapping[str, str] = os.environ,
) -> str | None:
    """The value llama-server takes for `option` (its flags, its variable) from these
    arguments, else from its variable; None when neither sets it."""
    flags, variable = option
    found = None
    for i, arg in enumerate(args):
        if arg in flags and i + 1 < len(args):
            found = args[i + 1]
        elif arg.startswith(tuple(f"{f}=" for f in flags)):
            found = arg.split("=", 1)[1]
    return found if found is not None else environ.get(variable)


def offloaded(args: Sequence[str], environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the operator asked llama-server to put layers on a GPU: then the weights
    and the KV cache are in its memory, not the container's."""
    layers = setting(args, GPU_LAYERS, environ)
    return layers is not None and layers.strip() not in ("0", "")


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
