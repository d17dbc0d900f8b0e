"""Managed mode's memory estimate from a GGUF's metadata, and the container limit it is
held against (the real llama-server's side: tests/real/test_managed_memory.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import structlog

from rerank_server.managed import memory, start
from rerank_server.managed.gguf_meta import Gguf
from rerank_server.managed.llama_server import ManagedLlamaServer

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


def test_the_head_width_is_the_width_over_the_first_layers_heads() -> None:
    """As llama.cpp takes it (`n_embd / n_head()`, layer 0), whatever the later layers."""
    meta = {
        **{k: v for k, v in QWEN3.items() if not k.endswith(("key_length", "value_length"))},
        "qwen3.block_count": 4,
        "qwen3.attention.head_count": [32, 16, 16, 16],
    }
    assert memory.kv_cache_bytes(header(meta), 1) == 4 * 8 * (32 + 32) * 2


def test_layers_without_heads_are_unknown_rather_than_a_crash() -> None:
    meta = {**QWEN3, "qwen3.block_count": 2, "qwen3.attention.head_count": [0, 16]}
    meta = {k: v for k, v in meta.items() if not k.endswith(("key_length", "value_length"))}
    assert memory.kv_cache_bytes(header(meta), 1) is None


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


@pytest.mark.parametrize("arch", ["bert", "nomic-bert", "modern-bert", "gemma-embedding"])
def test_an_encoder_keeps_no_kv_cache(arch: str) -> None:
    meta = {"general.architecture": arch, f"{arch}.block_count": 6}
    assert memory.kv_cache_bytes(header(meta), 4096) == 0


def test_llama_servers_variables_count_and_its_arguments_win() -> None:
    f16 = memory.kv_cache_bytes(header(QWEN3), 1024, [], {})
    assert f16 is not None
    q8 = {"LLAMA_ARG_CACHE_TYPE_K": "q8_0", "LLAMA_ARG_CACHE_TYPE_V": "q8_0"}
    assert memory.kv_cache_bytes(header(QWEN3), 1024, [], q8) == int(f16 * 34 / 64)
    assert memory.kv_cache_bytes(header(QWEN3), 1024, ["-ctk", "f16", "-ctv", "f16"], q8) == f16


def test_the_operators_context_size_is_the_one_estimated(tmp_path: Path) -> None:
    """An operator's `-c` comes after managed mode's and wins; `-c 0` is the trained one."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x")
    gguf = header({**QWEN3, "qwen3.context_length": 40960}, model)
    assert memory.estimate(gguf, 8 * 2048, [], {}).kv_cache_tokens == 8 * 2048
    assert memory.estimate(gguf, 8 * 2048, ["-c", "4096"], {}).kv_cache_tokens == 4096
    assert memory.estimate(gguf, 8 * 2048, ["--ctx-size=0"], {}).kv_cache_tokens == 40960
    assert memory.estimate(gguf, 1, [], {"LLAMA_ARG_CTX_SIZE": "512"}).kv_cache_tokens == 512


def test_layers_on_a_gpu_are_told_apart() -> None:
    assert not memory.offloaded([], {})
    assert not memory.offloaded(["-ngl", "0"], {})
    assert memory.offloaded(["--n-gpu-layers", "99"], {})
    assert memory.offloaded(["-ngl=all"], {})
    assert memory.offloaded([], {"LLAMA_ARG_N_GPU_LAYERS": "auto"})


def managed_server(
    tmp_path: Path, model: Path, args: list[str] | None = None
) -> ManagedLlamaServer:
    """A llama-server as managed mode describes it before starting it (never started)."""
    return ManagedLlamaServer(
        tmp_path / "llama-server",
        model,
        slots=8,
        ctx_per_slot=2048,
        extra_args=args or [],
        log_path=tmp_path / "llama-server.log",
    )


def test_a_start_past_the_container_limit_is_warned_of_before_it_begins(tmp_path: Path) -> None:
    model = tmp_path / "qwen3.gguf"
    model.write_bytes(b"x" * 1000)
    managed = managed_server(tmp_path, model)
    gguf = header(QWEN3, model)
    kv = 28 * 8 * 256 * 2 * 8 * 2048  # 1.75 GiB
    with structlog.testing.capture_logs() as logged:
        fits = start._say_memory(managed, "big", 0, 2 << 30, gguf)
        start._say_memory(managed, "big", (2 << 30) - kv - 1000 + 1, 2 << 30, gguf)
        start._say_memory(managed_server(tmp_path, model, ["-ngl", "99"]), "big", 4 << 30, 1, gguf)
        start._say_memory(managed, "unread", 0, 2 << 30, None)
    said = [e for e in logged if e["event"] == "llama_server_memory"]
    warned = [e for e in logged if e["event"] == "managed_memory_over_limit"]
    assert fits.total_bytes == 1000 + kv and said[0]["estimate_bytes"] == 1000 + kv
    assert said[0]["kv_cache_tokens"] == 8 * 2048 and said[0]["container_limit_bytes"] == 2 << 30
    # The second start alone is one byte over with the first; on a GPU, none is.
    assert [(w["served_as"], w["total_estimate_bytes"]) for w in warned] == [("big", (2 << 30) + 1)]
    assert "--llama-slots" in warned[0]["advice"]
    assert said[2]["gpu_layers"] == "99"
    assert said[3]["file_bytes"] == 1000 and said[3]["estimate_bytes"] is None


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
