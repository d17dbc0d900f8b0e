"""`bert_gguf.py`'s MiniLM-L6 GGUF is llama.cpp's own conversion, written with numpy alone.

The reference is `convert_hf_to_gguf.py`'s output for the same folder, which `make
test-assets` puts in the cache (`converted.prepare_rank_head_model`). Only the converter's
model-card keys may differ: every `general.*` key but the four below, which llama.cpp
reads. They are provenance for people (name, version, organization, basename, size label,
license, datasets, tags, languages), parsed from README.md's front matter and the base
model's name by the converter's heuristics; `bert_gguf.py` names the model after its
folder and writes none of the rest.
"""

from __future__ import annotations

import json
import shutil
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from rerank_server import settings
from rerank_server.managed import bert_gguf, converted, foreground
from rerank_server.managed.downloads import AssetError
from rerank_server.server import build_server
from rerank_server.settings import Settings
from tests.conftest import client_of
from tests.real.conftest import assets_or_fail

COMPARED_GENERAL = (
    "general.architecture",
    "general.type",
    "general.file_type",
    "general.quantization_version",
)


def exempt(key: str) -> bool:
    return key.startswith("general.") and key not in COMPARED_GENERAL


@dataclass(frozen=True)
class Gguf:
    """A GGUF file in full: its keys in order (each a value type and value), its
    tensors in order (name, GGUF shape, ggml type) and each tensor's bytes."""

    meta: dict[str, tuple[int, Any]]
    tensors: list[tuple[str, tuple[int, ...], int]]
    data: dict[str, bytes]


_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_TYPE_SIZE = {0: 4, 1: 2}  # f32, f16: all these files hold


def read_gguf(path: Path) -> Gguf:
    buf = path.read_bytes()
    pos = 0

    def take(fmt: str) -> Any:
        nonlocal pos
        (value,) = struct.unpack_from("<" + fmt, buf, pos)
        pos += struct.calcsize("<" + fmt)
        return value

    def string() -> str:
        nonlocal pos
        length = take("Q")
        pos += length
        return buf[pos - length : pos].decode("utf-8")

    def value(kind: int) -> Any:
        if kind == 8:
            return string()
        if kind == 9:
            item, count = take("I"), take("Q")
            return (item, [value(item) for _ in range(count)])
        return take(_SCALARS[kind])

    assert buf[:4] == b"GGUF"
    pos = 4
    assert take("I") == 3
    n_tensors, n_keys = take("Q"), take("Q")
    meta = {}
    for _ in range(n_keys):
        key = string()
        kind = take("I")
        meta[key] = (kind, value(kind))
    infos = []
    for _ in range(n_tensors):
        name = string()
        shape = tuple(take("Q") for _ in range(take("I")))
        infos.append((name, shape, take("I"), take("Q")))
    align = meta.get("general.alignment", (4, 32))[1]
    start = -(-pos // align) * align
    data = {}
    for name, shape, kind, offset in infos:
        size = _TYPE_SIZE[kind]
        for n in shape:
            size *= n
        data[name] = buf[start + offset : start + offset + size]
    return Gguf(meta, [(n, s, k) for n, s, k, _ in infos], data)


def cached(path: Path) -> Path:
    if not path.exists():
        pytest.fail(f"real-backend assets missing: {path}; run `make test-assets`", pytrace=False)
    return path


@pytest.mark.real_backend
def test_numpy_conversion_equals_llama_cpps_converter(tmp_path: Path) -> None:
    """Key by key (types, values, order) and tensor by tensor (names, shapes, types,
    order, bytes), but for the exempt model-card keys."""
    cache = settings.load([]).cache_dir
    reference = cached(converted.reference_embedding_model_path(cache))
    hf_dir = cached(converted.minilm_folder_path(cache))
    out = tmp_path / "minilm.gguf"
    started = time.perf_counter()
    bert_gguf.convert(hf_dir, out)
    print(f"bert_gguf.convert: {time.perf_counter() - started:.2f}s")

    mine, theirs = read_gguf(out), read_gguf(reference)
    compared = {k: v for k, v in theirs.meta.items() if not exempt(k)}
    assert {k: v for k, v in mine.meta.items() if not exempt(k)} == compared
    assert [k for k in mine.meta if not exempt(k)] == list(compared)
    assert [k for k in mine.meta if exempt(k)] == ["general.name"]
    assert mine.meta["general.name"] == (8, "all-MiniLM-L6-v2")
    assert mine.tensors == theirs.tensors
    assert len(mine.tensors) == 101
    for name, _, _ in theirs.tensors:
        assert mine.data[name] == theirs.data[name], name


@pytest.mark.real_backend
async def test_numpy_conversion_ranks_through_the_embedding_backend(tmp_path: Path) -> None:
    """llama-server loads the file, and the `embedding` backend ranks with it."""
    binary, _ = assets_or_fail()
    loaded = settings.load([])
    model = tmp_path / "all-MiniLM-L6-v2.f16.gguf"
    bert_gguf.convert(cached(converted.minilm_folder_path(loaded.cache_dir)), model)
    docs = [
        "The stock market fell.",
        "Cats are obligate carnivores that eat meat.",
        "Kittens need milk.",
    ]
    args = ["--embedding", "--pooling", "mean", "-np", "2", "-c", "1024", "-b", "512", "-ub", "512"]
    log = tmp_path / "llama-server.log"
    with log.open("wb") as output:
        try:
            with foreground.llama_server(
                binary,
                model,
                args,
                cache=loaded.cache_dir,
                amx_mode=loaded.llama_amx,
                output=output,
            ) as served:
                server = await build_server(
                    Settings(
                        port=0,
                        backend_url=served.url,
                        backend="embedding",
                        http_port=0,
                        probe=False,
                        metrics=False,
                        cache_entries=0,
                    )
                )
                try:
                    async with client_of(server) as client:
                        answer = await client.rerank(
                            "what do cats eat?", docs, blend_strategy="rerank_only"
                        )
                finally:
                    await server.stop(grace=0)
        except foreground.NotReady as exc:
            pytest.fail(f"llama-server {exc}: {log.read_text()[-2000:]}")
    assert answer.reranked and answer.summary.failed == 0
    assert answer.summary.model == model.name
    scores = {r.id: r.reranker_score or 0.0 for r in answer.results}
    assert [r.id for r in answer.results] == ["1", "2", "0"], scores
    assert scores["1"] > scores["2"] + 0.1, scores


def minilm_like(tmp_path: Path) -> Path:
    """A folder with the files a BERT conversion reads first, enough to be refused by."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    (folder / "tokenizer.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", 2) + b"{}")
    return folder


def test_a_folder_without_weights_is_refused_by_name(tmp_path: Path) -> None:
    folder = minilm_like(tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(AssetError, match=r"lacks model\.safetensors"):
        bert_gguf.convert(folder, tmp_path / "out.gguf")
    shutil.rmtree(folder)
    folder.mkdir()
    with pytest.raises(AssetError, match=r"config\.json, model\.safetensors, tokenizer\.json"):
        bert_gguf.convert(folder, tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()


def test_another_architecture_is_refused_by_name(tmp_path: Path) -> None:
    folder = minilm_like(tmp_path)
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(AssetError, match="architecture Qwen3ForCausalLM, not one of BertModel"):
        bert_gguf.convert(folder, tmp_path / "out.gguf")


def test_a_tokenizer_other_than_wordpiece_is_refused(tmp_path: Path) -> None:
    """A BERT-shaped config over a BPE tokenizer (a RoBERTa folder relabelled) is refused
    by what its tokenizer is, before any tensor is written."""
    folder = minilm_like(tmp_path)
    config = {"architectures": ["BertModel"], "num_hidden_layers": 0}
    (folder / "config.json").write_text(json.dumps(config))
    tokenizer = {
        "model": {"type": "BPE", "vocab": {}},
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel"},
    }
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(AssetError, match="a BPE/None/ByteLevel tokenizer, not BERT's"):
        bert_gguf.convert(folder, tmp_path / "out.gguf")
