"""Managed mode's memory estimate from a GGUF's metadata, and the container limit it is
held against (the real llama-server's side: tests/real/test_managed_memory.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from rerank_server.managed import memory
from rerank_server.managed.gguf_meta import Gguf

# Qwen3-Reranker-0.6B's attention: 28 layers, 16 heads, 8 KV heads of 128.
QWEN3 = {
    "general.architecture": "qwen3",
    "qwen3.block_count": 28,
    "qwen3.embedding_length": 1024,
    "qwen3.attention.head_count": 16,
    "qwen3.attention.head_count_kv": 8,
    "qwen3.attention.key_length": 128,
    "qwen3.attention.value_length": 128,
}


def header(meta: dict[str, Any], path: Path = Path("/nonexistent.gguf")) -> Gguf:
    return Gguf(path, meta, {}, {})


def test_a_causal_model_keeps_k_and_v_of_its_kv_heads_for_every_token() -> None:
    # 28 layers x 8 heads x (128 + 128) x 2 bytes: 112 KiB a token.
    assert memory.kv_cache_bytes(header(QWEN3), 8 * 2048) == 28 * 8 * 256 * 2 * 8 * 2048


def test_the_head_width_defaults_to_the_width_over_the_heads() -> None:
    meta = {k: v for k, v in QWEN3.items() if not k.endswith(("key_length", "value_length"))}
    assert memory.kv_cache_bytes(header(meta), 1) == 28 * 8 * (64 + 64) * 2


def test_an_operators_cache_type_is_read_from_llama_servers_arguments() -> None:
    f16 = memory.kv_cache_bytes(header(QWEN3), 1024)
    assert f16 is not None
    q8 = memory.kv_cache_bytes(header(QWEN3), 1024, ["-ctk", "q8_0", "--cache-type-v=q8_0"])
    assert q8 == int(f16 * 34 / 64)
    only_k = memory.kv_cache_bytes(header(QWEN3), 1024, ["--cache-type-k", "f32"])
    assert only_k == int(f16 * 3 / 2)


def test_per_layer_counts_and_layers_without_attention() -> None:
    """A hybrid model lists KV heads per layer, 0 for a recurrent layer."""
    meta = {**QWEN3, "qwen3.block_count": 4, "qwen3.attention.head_count_kv": [8, 0, 8, 0]}
    assert memory.kv_cache_bytes(header(meta), 1) == 2 * 8 * 256 * 2


@pytest.mark.parametrize("arch", ["bert", "nomic-bert"])
def test_an_encoder_keeps_no_kv_cache(arch: str) -> None:
    meta = {"general.architecture": arch, f"{arch}.block_count": 6}
    assert memory.kv_cache_bytes(header(meta), 4096) == 0


def test_missing_metadata_is_unknown_not_an_error(tmp_path: Path) -> None:
    meta = {k: v for k, v in QWEN3.items() if k != "qwen3.block_count"}
    assert memory.kv_cache_bytes(header(meta), 1024) is None
    broken = {**QWEN3, "qwen3.attention.head_count_kv": [8, 8]}  # not one per layer
    assert memory.kv_cache_bytes(header(broken), 1024) is None
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x" * 1000)
    unknown = memory.estimate(header(meta, model), 1024, [])
    assert unknown.file_bytes == 1000 and unknown.total_bytes is None


@pytest.mark.parametrize(
    ("files", "limit"),
    [
        ({"memory.max": "4294967296\n"}, 4 << 30),
        ({"memory.max": "max\n"}, None),
        ({"memory/memory.limit_in_bytes": "2147483648\n"}, 2 << 30),
        ({"memory/memory.limit_in_bytes": "9223372036854771712\n"}, None),  # v1: none
        ({}, None),
    ],
)
def test_the_container_limit_from_cgroup_v2_or_v1(
    tmp_path: Path, files: dict[str, str], limit: int | None
) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert memory.container_limit(tmp_path) == limit


def test_resident_memory_of_a_process_and_of_none() -> None:
    mine = memory.resident_bytes(os.getpid())
    assert mine is not None and mine > 10 << 20
    assert memory.resident_bytes(None) is None
    assert memory.resident_bytes(2**22 + 12345) is None  # past pid_max: no such process
