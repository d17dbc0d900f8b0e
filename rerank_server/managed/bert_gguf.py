"""A BERT sentence-transformers folder (MiniLM-L6) as an f16 GGUF, with numpy alone.

It writes what llama.cpp's `convert_hf_to_gguf.py` writes for such a folder: the same
metadata in the same order, the same tensors (names, shapes, types, bytes) and layout,
but none of the converter's model-card keys (`general.*` read from README.md). Without
torch, transformers or the `gguf` package, `rerank-server prepare` converts MiniLM-L6 in
seconds on a fresh machine; `tests/real/test_minilm_gguf.py` holds the result to the
converter's. A folder outside what it knows (another architecture, a tokenizer other than
BERT's WordPiece, a missing file) is refused by name.
"""

from __future__ import annotations

import hashlib
import json
import struct
import unicodedata
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from .downloads import AssetError

ARCHITECTURES = ("BertModel", "BertForMaskedLM")
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")
ALIGNMENT = 32  # GGUF's default; every tensor starts on it
FILE_TYPE_F16 = 1  # llama.cpp's LLAMA_FTYPE_MOSTLY_F16
QUANTIZATION_VERSION = 2  # ggml's GGML_QNT_VERSION, which the converter writes
GGML_F32, GGML_F16 = 0, 1

# GGUF value types (ggml's docs/gguf.md)
_U32, _I32, _F32, _BOOL, _STRING, _ARRAY = 4, 5, 6, 7, 8, 9

# llama.cpp's token types and pooling types
_NORMAL, _CONTROL, _USER_DEFINED, _UNUSED = 1, 3, 4, 5
_POOLING = {"mean": 1, "cls": 2, "lasttoken": 3}

# Hugging Face BERT tensor names (without `bert.`) to GGUF's: the embeddings, then a layer's.
_EMBEDDINGS = {
    "embeddings.word_embeddings": "token_embd",
    "embeddings.token_type_embeddings": "token_types",
    "embeddings.position_embeddings": "position_embd",
    "embeddings.LayerNorm": "token_embd_norm",
}
_LAYER = {
    "attention.self.query": "attn_q",
    "attention.self.key": "attn_k",
    "attention.self.value": "attn_v",
    "attention.output.dense": "attn_output",
    "attention.output.LayerNorm": "attn_output_norm",
    "intermediate.dense": "ffn_up",
    "output.dense": "ffn_down",
    "output.LayerNorm": "layer_output_norm",
}
# An embedding model has no use for these; the converter drops them too.
_DROPPED = ("embeddings.position_ids", "pooler.", "cls.predictions.", "cls.seq_relationship.")
# 2-D, yet kept f32 as llama.cpp keeps them (its quantizer never touches them).
_F32_MATRICES = ("position_embd.weight", "token_types.weight")

# The converter names a tokenizer's pre-tokenizer by the sha256 of the ids it gives this
# text (`get_vocab_base_pre`); llama.cpp ignores the name for WordPiece vocabularies, but
# it is part of the file. These are the WordPiece entries of its table.
_CHECK_TEXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n\U0001f680 (normal) \U0001f636\u200d"
    "\U0001f32b\ufe0f (multiple emojis concatenated) \u2705 \U0001f999\U0001f999 3 33 333 "
    "3333 33333 333333 3333333 33333333 3.3 3..3 3...3 \u1780\u17b6\u1793\u17cb\u178f\u17c2"
    "\u1796\u17b7\u179f\u17c1\u179f\u17a2\u17b6\u1785\U0001f601 ?\u6211\u60f3\u5728apple"
    "\u5de5\u4f5c1314151\u5929\uff5e ------======= \u043d\u0435\u0449\u043e \u043d\u0430 "
    "\u0411\u044a\u043b\u0433\u0430\u0440\u0441\u043a\u0438 ''''''```````\"\"\"\"......"
    "!!!!!!?????? I've been 'told he's there, 'RE you sure? 'M not sure I'll make it, 'D "
    "you like some tea? We'Ve a'lL"
)
_PRE_TOKENIZERS = {
    # bert-base-uncased's vocabulary (MiniLM, bge-small-en); the converter's table names
    # it twice and keeps its last match
    "0876d13b50744004aa9aeae05e7b0647eac9d801b5ba4668afc01e709c15e19f": "jina-v2-en",
    "8e62295832751ca1e8f92f2226f403dea30dc5165e448b5bfa05af5340c64ec7": "bert-bge-large",
}

_SAFETENSORS_DTYPES = {"F32": "<f4", "F16": "<f2", "BF16": "<u2"}

Array = npt.NDArray[Any]


@dataclass(frozen=True)
class _Tensor:
    name: str
    shape: tuple[int, ...]  # numpy's order; GGUF stores it reversed
    ggml_type: int
    load: Callable[[], Array]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * (4 if self.ggml_type == GGML_F32 else 2)


def convert(hf_dir: Path, out: Path) -> None:
    """Write `hf_dir` (a Hugging Face BERT folder, as sentence-transformers ships one) to
    `out` as an f16 GGUF: 2-D weights f16, norms, biases and the position and token-type
    embeddings f32, as llama.cpp's converter writes them. AssetError when the folder is
    not one this understands."""
    missing = [name for name in REQUIRED_FILES if not (hf_dir / name).is_file()]
    if missing:
        raise AssetError(f"{hf_dir} is no BERT model folder: it lacks {', '.join(missing)}")
    config = _json(hf_dir / "config.json")
    arch = (config.get("architectures") or ["(none)"])[0]
    if arch not in ARCHITECTURES:
        raise AssetError(
            f"{hf_dir / 'config.json'}: architecture {arch}, not one of {', '.join(ARCHITECTURES)}"
        )
    vocabulary = _tokenizer(hf_dir, config)
    blocks = _hparam(config, "num_hidden_layers", hf_dir)
    tensors = _tensors(hf_dir / "model.safetensors", blocks)
    meta = {
        "general.architecture": _string("bert"),
        "general.type": _string("model"),
        "general.name": _string(hf_dir.name),
        "bert.block_count": _u32(blocks),
        "bert.context_length": _u32(_hparam(config, "max_position_embeddings", hf_dir)),
        "bert.embedding_length": _u32(_hparam(config, "hidden_size", hf_dir)),
        "bert.feed_forward_length": _u32(_hparam(config, "intermediate_size", hf_dir)),
        "bert.attention.head_count": _u32(_hparam(config, "num_attention_heads", hf_dir)),
        "bert.attention.layer_norm_epsilon": _f32(_hparam(config, "layer_norm_eps", hf_dir)),
        "general.file_type": _u32(FILE_TYPE_F16),
        "bert.attention.causal": _bool(False),
    }
    if (pooling := _pooling(hf_dir)) is not None:
        meta["bert.pooling_type"] = _u32(pooling)
    meta["general.quantization_version"] = _u32(QUANTIZATION_VERSION)
    meta.update(vocabulary)
    _write(out, meta, tensors)


def _tensors(path: Path, blocks: int) -> list[_Tensor]:
    """The tensors of a safetensors file (8 bytes of header length, the JSON header, the
    data) under their GGUF names, in the file's order, read when written."""
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + length)
    except (ValueError, struct.error) as exc:
        raise AssetError(f"{path} is not a safetensors file: {exc}") from None
    out = []
    for hf_name, info in header.items():
        if hf_name == "__metadata__":
            continue
        short = hf_name.removeprefix("bert.")
        if short.startswith(_DROPPED):
            continue
        name = _gguf_name(short, blocks)
        if name is None:
            raise AssetError(f"{path}: tensor {hf_name} is not part of a BERT model")
        dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
        shape = tuple(int(n) for n in info["shape"])
        start, end = info["data_offsets"]
        if dtype is None or not 0 <= start <= end <= data.size:
            raise AssetError(f"{path}: tensor {hf_name} is {info['dtype']} at {start}..{end}")
        if end - start != int(np.prod(shape)) * np.dtype(dtype).itemsize:
            raise AssetError(f"{path}: tensor {hf_name} has {end - start} bytes for {shape}")
        f16 = len(shape) > 1 and name.endswith(".weight") and not name.endswith("_norm.weight")
        f16 = f16 and name not in _F32_MATRICES
        raw = data[start:end]
        out.append(
            _Tensor(
                name,
                shape,
                GGML_F16 if f16 else GGML_F32,
                partial(_cast, raw, dtype, shape, f16),
            )
        )
    return out


def _gguf_name(name: str, blocks: int) -> str | None:
    module, _, suffix = name.rpartition(".")
    suffix = {"gamma": "weight", "beta": "bias"}.get(suffix, suffix)
    if suffix not in ("weight", "bias"):
        return None
    if module in _EMBEDDINGS:
        return f"{_EMBEDDINGS[module]}.{suffix}"
    parts = module.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["encoder", "layer"] and parts[2].isdecimal():
        block, rest = int(parts[2]), parts[3]
        if block < blocks and rest in _LAYER:
            return f"blk.{block}.{_LAYER[rest]}.{suffix}"
    return None


def _cast(raw: Array, dtype: str, shape: tuple[int, ...], f16: bool) -> Array:
    values = raw.view(dtype).reshape(shape)
    if dtype == "<u2":  # bfloat16: the high half of a float32
        values = (values.astype("<u4") << 16).view("<f4")
    return values.astype("<f2" if f16 else "<f4")


def _pooling(hf_dir: Path) -> int | None:
    """The sentence-transformers pooling (modules.json's Pooling module), as llama.cpp's
    pooling type; None without modules.json (the converter then writes none)."""
    if not (hf_dir / "modules.json").is_file():
        return None
    modules = _json(hf_dir / "modules.json")
    path = next((m["path"] for m in modules if str(m.get("type", "")).endswith("Pooling")), None)
    if path is None:
        return None
    config = _json(hf_dir / path / "config.json")
    for mode, flag in (("mean", "mean_tokens"), ("cls", "cls_token"), ("lasttoken", "lasttoken")):
        if config.get(f"pooling_mode_{flag}"):
            return _POOLING[mode]
    if (mode := config.get("pooling_mode")) in _POOLING:
        return _POOLING[mode]
    raise AssetError(f"{hf_dir / path / 'config.json'}: pooling is not mean, cls or last token")


def _tokenizer(hf_dir: Path, config: dict[str, Any]) -> dict[str, bytes]:
    """The `tokenizer.*` keys: WordPiece tokens as llama.cpp spells them (a word start
    gets U+2581, a `##` continuation loses it), their types, the special ids and flags."""
    tokenizer = _json(hf_dir / "tokenizer.json")
    model = tokenizer.get("model") or {}
    kinds = (
        model.get("type"),
        (tokenizer.get("normalizer") or {}).get("type"),
        (tokenizer.get("pre_tokenizer") or {}).get("type"),
    )
    if kinds != ("WordPiece", "BertNormalizer", "BertPreTokenizer"):
        raise AssetError(
            f"{hf_dir / 'tokenizer.json'}: a {'/'.join(map(str, kinds))} tokenizer, not BERT's "
            "WordPiece/BertNormalizer/BertPreTokenizer"
        )
    added = {t["content"]: t for t in tokenizer.get("added_tokens", [])}
    ids: dict[str, int] = {**model["vocab"], **{c: t["id"] for c, t in added.items()}}
    size = config.get("vocab_size", len(ids))
    if max(ids.values()) >= size:
        raise AssetError(f"{hf_dir}: token id {max(ids.values())} past vocab_size {size}")
    by_id = {i: token for token, i in ids.items()}
    tokens, types = [], []
    for i in range(size):
        token = by_id.get(i)
        if token is None:
            token, kind = f"[PAD{i}]", _UNUSED
        elif token in added and (added[token].get("special") or _looks_special(token)):
            kind = _CONTROL
        elif token in added:
            token, kind = token.replace("\u2581", " "), _USER_DEFINED
        else:
            kind = _NORMAL
        if kind != _CONTROL:
            token = token[2:] if token.startswith("##") else "\u2581" + token
        tokens.append(token)
        types.append(kind)
    chkhsh = hashlib.sha256(str(_encode(tokenizer, _CHECK_TEXT)).encode()).hexdigest()
    if chkhsh not in _PRE_TOKENIZERS:
        raise AssetError(
            f"{hf_dir / 'tokenizer.json'}: a WordPiece pre-tokenizer llama.cpp's converter "
            f"does not know (check hash {chkhsh})"
        )
    meta = {
        "tokenizer.ggml.token_type_count": _u32(config.get("type_vocab_size", 1)),
        "tokenizer.ggml.model": _string("bert"),
        "tokenizer.ggml.pre": _string(_PRE_TOKENIZERS[chkhsh]),
        "tokenizer.ggml.tokens": _strings(tokens),
        "tokenizer.ggml.token_type": _i32s(types),
    }
    meta.update(_special_tokens(hf_dir, tokenizer, config, size))
    normalizer = tokenizer["normalizer"]
    for flag in ("lowercase", "strip_accents"):
        if isinstance(normalizer.get(flag), bool):
            meta[f"tokenizer.ggml.normalizer.{flag}"] = _bool(normalizer[flag])
    return meta


def _looks_special(token: str) -> bool:
    """Added tokens the converter marks as control though not flagged special."""
    return (
        token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
        or (token.startswith("<unused") and token.endswith(">"))
    )


_SPECIAL_KEYS = {
    "bos": "bos_token_id",
    "eos": "eos_token_id",
    "unk": "unknown_token_id",
    "sep": "seperator_token_id",  # sic: llama.cpp's key
    "pad": "padding_token_id",
    "mask": "mask_token_id",
}


def _special_tokens(
    hf_dir: Path, tokenizer: dict[str, Any], config: dict[str, Any], size: int
) -> dict[str, bytes]:
    """The special ids and add-flags, as gguf-py's SpecialVocab finds them for a BERT
    tokenizer: names from tokenizer_config.json (bos falling back to cls, eos to sep)
    looked up among the added tokens, then config.json's `*_token_id`; the flags from the
    post-processor's templates, then tokenizer_config.json's `add_*_token`."""
    path = hf_dir / "tokenizer_config.json"
    names: dict[str, Any] = {
        k: v.get("content") if isinstance(v, dict) else v
        for k, v in (_json(path) if path.is_file() else {}).items()
    }
    if names:
        names["bos_token"] = names.get("bos_token") or names.get("cls_token")
        names["eos_token"] = names.get("eos_token") or names.get("sep_token")
    added = {t["content"]: t["id"] for t in reversed(tokenizer.get("added_tokens", []))}
    found: dict[str, int] = {}
    for kind in _SPECIAL_KEYS:
        token_id = added.get(names.get(f"{kind}_token"))
        if isinstance(token_id, int) and token_id < size:
            found[kind] = token_id
    for kind in _SPECIAL_KEYS:
        token_id = config.get(f"{kind}_token_id")
        if isinstance(token_id, int) and 0 <= token_id < size:
            found.setdefault(kind, token_id)
    flags = _template_flags(hf_dir, tokenizer, names)
    for kind in ("bos", "eos", "sep"):
        if isinstance(add := names.get(f"add_{kind}_token"), bool):
            flags.setdefault(kind, add)
    return {
        **{f"tokenizer.ggml.{_SPECIAL_KEYS[k]}": _u32(v) for k, v in found.items()},
        **{f"tokenizer.ggml.add_{k}_token": _bool(v) for k, v in flags.items()},
    }


def _template_flags(
    hf_dir: Path, tokenizer: dict[str, Any], names: dict[str, Any]
) -> dict[str, bool]:
    """add_bos/add_eos/add_sep from a `[CLS] $A [SEP]` / `[CLS] $A [SEP] $B [SEP]`
    TemplateProcessing; none from another post-processor, as the converter."""
    post = tokenizer.get("post_processor") or {}
    if post.get("type") != "TemplateProcessing":
        return {}
    single = [_special(item) for item in post.get("single", [])]
    if len(single) < 2 or single[0] is None or single[-1] is None:
        raise AssetError(f"{hf_dir / 'tokenizer.json'}: its template adds no [CLS] ... [SEP]")
    first, last = single[0], single[-1]
    cls = (names.get("bos_token"), names.get("cls_token"))
    if names and (first not in cls or last != names.get("eos_token")):
        raise AssetError(
            f"{hf_dir / 'tokenizer.json'}: its template adds {first} and {last}, "
            "not tokenizer_config.json's cls and sep tokens"
        )
    flags = {"bos": True, "eos": True}
    pair = post.get("pair", [])
    start = 1 if pair and _special(pair[0]) == first else 0
    stop = -1 if pair and _special(pair[-1]) == last else None
    pair = pair[start:stop]
    if len(pair) > 2 and [p.get("Sequence", {}).get("id") for p in (pair[0], pair[-1])] == [
        "A",
        "B",
    ]:
        middle = pair[1:-1]
        second = _special(middle[-1]) if len(middle) == 2 else None
        flags["sep"] = second is not None and second in (names.get("sep_token"), last)
    return flags


def _special(item: dict[str, Any]) -> str | None:
    token = item.get("SpecialToken", {}).get("id")
    return token if isinstance(token, str) else None


def _encode(tokenizer: dict[str, Any], text: str) -> list[int]:
    """`text`'s ids as the tokenizer gives them with its special tokens: BERT's
    normalizer, whitespace-and-punctuation split and greedy longest-match WordPiece."""
    normalizer, model = tokenizer["normalizer"], tokenizer["model"]
    vocab: dict[str, int] = model["vocab"]
    if normalizer.get("clean_text", True):
        text = "".join(
            " " if c.isspace() else c
            for c in text
            if c in "\t\n\r" or not (c in "\0\ufffd" or unicodedata.category(c)[0] == "C")
        )
    if normalizer.get("handle_chinese_chars", True):
        text = "".join(f" {c} " if _chinese(c) else c for c in text)
    lowercase = normalizer.get("lowercase", True)
    strip = normalizer.get("strip_accents")
    if strip if strip is not None else lowercase:
        text = "".join(
            c for c in unicodedata.normalize("NFD", text) if unicodedata.category(c) != "Mn"
        )
    if lowercase:
        text = text.lower()
    ids = []
    for word in _bert_words(text):
        ids.extend(_wordpiece(word, vocab, model))
    post = tokenizer.get("post_processor") or {}
    if post.get("type") == "TemplateProcessing":
        out: list[int] = []
        for item in post["single"]:
            special = _special(item)
            out.extend(post["special_tokens"][special]["ids"] if special else ids)
        return out
    if post.get("type") == "BertProcessing":
        return [post["cls"][1], *ids, post["sep"][1]]
    return ids


def _bert_words(text: str) -> Iterable[str]:
    """Split on whitespace (dropped) and around each punctuation character (kept)."""
    word: list[str] = []
    for c in text:
        if c.isspace() or _punctuation(c):
            if word:
                yield "".join(word)
                word = []
            if not c.isspace():
                yield c
        else:
            word.append(c)
    if word:
        yield "".join(word)


def _wordpiece(word: str, vocab: dict[str, int], model: dict[str, Any]) -> list[int]:
    unknown = [vocab[model["unk_token"]]]
    if len(word) > model.get("max_input_chars_per_word", 100):
        return unknown
    prefix = model.get("continuing_subword_prefix", "##")
    ids, start = [], 0
    while start < len(word):
        for end in range(len(word), start, -1):
            piece = word[start:end] if start == 0 else prefix + word[start:end]
            if piece in vocab:
                ids.append(vocab[piece])
                start = end
                break
        else:
            return unknown
    return ids


def _punctuation(c: str) -> bool:
    return (c.isascii() and not c.isalnum() and c.isprintable() and not c.isspace()) or (
        unicodedata.category(c)[0] == "P"
    )


def _chinese(c: str) -> bool:
    cp = ord(c)
    return any(
        lo <= cp <= hi
        for lo, hi in (
            (0x4E00, 0x9FFF),
            (0x3400, 0x4DBF),
            (0x20000, 0x2A6DF),
            (0x2A700, 0x2B73F),
            (0x2B740, 0x2B81F),
            (0x2B820, 0x2CEAF),
            (0xF900, 0xFAFF),
            (0x2F800, 0x2FA1F),
        )
    )


def _write(out: Path, meta: dict[str, bytes], tensors: list[_Tensor]) -> None:
    """GGUF v3: the header, the key/values, the tensor infos (reversed shape, type, offset
    into the data), padding to ALIGNMENT, then each tensor padded to ALIGNMENT."""
    head = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(meta)))
    for key, value in meta.items():
        head += _bytes(key) + value
    offset = 0
    for t in tensors:
        head += _bytes(t.name) + struct.pack(f"<I{len(t.shape)}Q", len(t.shape), *t.shape[::-1])
        head += struct.pack("<IQ", t.ggml_type, offset)
        offset += _padded(t.nbytes)
    head += bytes(_padded(len(head)) - len(head))
    with out.open("wb") as f:
        f.write(head)
        for t in tensors:
            data = t.load()
            f.write(data.tobytes())
            f.write(bytes(_padded(t.nbytes) - t.nbytes))


def _padded(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def _bytes(text: str) -> bytes:
    data = text.encode("utf-8")
    return struct.pack("<Q", len(data)) + data


def _string(value: str) -> bytes:
    return struct.pack("<I", _STRING) + _bytes(value)


def _u32(value: int) -> bytes:
    return struct.pack("<II", _U32, value)


def _f32(value: float) -> bytes:
    return struct.pack("<If", _F32, value)


def _bool(value: bool) -> bytes:
    return struct.pack("<I?", _BOOL, value)


def _strings(values: list[str]) -> bytes:
    return struct.pack("<IIQ", _ARRAY, _STRING, len(values)) + b"".join(map(_bytes, values))


def _i32s(values: list[int]) -> bytes:
    return struct.pack("<IIQ", _ARRAY, _I32, len(values)) + np.asarray(values, "<i4").tobytes()


def _hparam(config: dict[str, Any], key: str, hf_dir: Path) -> Any:
    if key not in config:
        raise AssetError(f"{hf_dir / 'config.json'} has no {key}")
    return config[key]


def _json(path: Path) -> Any:
    if not path.is_file():
        raise AssetError(f"{path} is missing")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise AssetError(f"{path} is not JSON: {exc}") from None
