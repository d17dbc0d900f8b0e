"""A speed twin of Qwen3-Reranker-0.6B: its architecture and sizes, random weights.

Run as `python speed_twin.py TOKENIZER.gguf OUT.gguf {q8_0,f16} {lm,rank,rank-tied}`.
"""

from __future__ import annotations

import sys

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.constants import Keys, PoolingType
from gguf.quants import quantize

N_LAYER, N_EMBD, N_HEAD, N_HEAD_KV, HEAD_DIM, N_FF = 28, 1024, 16, 8, 128, 3072
ARCH = "qwen3"
RERANK_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the "
    'Query and the Instruct provided. Note that the answer can only be "yes" or "no".'
    "<|im_end|>\n<|im_start|>user\n<Instruct>: Given a web search query, retrieve relevant "
    "passages that answer the query\n<Query>: {query}\n<Document>: {document}<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
)


def _copy_tokenizer(reader: GGUFReader, writer: GGUFWriter) -> list[str]:
    """Every `tokenizer.*` field of `reader`, as it is; the vocabulary."""
    tokens: list[str] = []
    for field in reader.fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            item = field.types[1]
            values = [field.parts[i] for i in field.data]
            if item == GGUFValueType.STRING:
                values = [bytes(v).decode("utf-8", errors="replace") for v in values]
            else:
                values = [v.tolist()[0] for v in values]
            writer.add_array(field.name, values)
            if field.name == Keys.Tokenizer.LIST:
                tokens = values
        elif kind == GGUFValueType.STRING:
            writer.add_string(field.name, bytes(field.parts[field.data[0]]).decode())
        else:
            value = field.parts[field.data[0]].tolist()[0]
            {
                GGUFValueType.UINT32: writer.add_uint32,
                GGUFValueType.INT32: writer.add_int32,
                GGUFValueType.BOOL: writer.add_bool,
                GGUFValueType.FLOAT32: writer.add_float32,
            }.get(kind, writer.add_uint32)(field.name, value)
    return tokens


def _random(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.standard_normal(shape, dtype=np.float32) * 0.02


def _store(writer: GGUFWriter, name: str, data: np.ndarray, kind: str) -> None:
    """`data` (numpy shape: rows, columns) in the file's type. q8_0 quantizes blocks of 32
    along a row, so equal rows are equal bytes wherever they are stored."""
    if kind == "f16":
        writer.add_tensor(name, data.astype(np.float16))
    else:
        writer.add_tensor(
            name, quantize(data, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0
        )


def _tensor(
    writer: GGUFWriter,
    name: str,
    shape: tuple[int, ...],
    kind: str,
    rng: np.random.Generator,
    norm: bool = False,
) -> None:
    """A random weight, or a norm of ones (kept F32)."""
    if norm:
        writer.add_tensor(name, np.ones(shape, dtype=np.float32))
    else:
        _store(writer, name, _random(rng, shape), kind)


ANCHOR, ANSWER_LIFT = 30.0, 2.0
HEADS = ("lm", "rank", "rank-tied")
CONVERTER_ANSWERS = ("yes", "no")  # `cls.output`'s rows, in this order


def _answers(tokens: list[str], rank: bool) -> list[int]:
    """The answer tokens the twin favours. For `lm`, every spelling `logprobs.p_yes`
    reads ("yes", "No", " yes": BPE's "Ġ" is a space). For a rank head, the tokens "yes"
    and "no" themselves, whose rows llama.cpp's converter puts in `cls.output`
    (`convert_tokens_to_ids`), as a trained Qwen3-Reranker answers: `completion` pools
    every spelling and `--rerank` reads only these two, so lifting the others would make
    the two paths differ by the twin's invention."""
    if not rank:
        return [
            i
            for i, t in enumerate(tokens)
            if t.replace("\u0120", " ").strip().lower() in CONVERTER_ANSWERS
        ]
    missing = [t for t in CONVERTER_ANSWERS if t not in tokens]
    if missing:
        raise SystemExit(f"no token {missing[0]!r} in the tokenizer's vocabulary")
    return [tokens.index(t) for t in CONVERTER_ANSWERS]


def _anchor(embd: np.ndarray, answers: list[int]) -> np.ndarray:
    """Random weights give no next token a preference: "yes" and "no" would seldom be
    among the top 20 logprobs the scorers read. So dimension 0 of every embedding is
    `ANCHOR`, far above what the 28 random layers add to the residual stream there (a few
    units), which keeps that dimension large and positive up to the (tied) LM head; the
    answers' rows carry `ANSWER_LIFT` more, which raises their logits over every other
    token's by far more than the random spread. The anchor dominates the residual
    stream, so every pair gets nearly the same P(yes); it meant nothing anyway. The
    shapes, and so the work, are the model's."""
    embd[:, 0] = ANCHOR
    embd[answers, 0] += ANSWER_LIFT
    return embd


def main(tokenizer: str, out: str, kind: str, head: str) -> None:
    """Write the twin to `out`, `kind` q8_0 or f16, with `tokenizer`'s tokenizer whole.

    `head` `lm` keeps the causal LM head (the `chat` and `completion` paths); `rank` adds
    what llama.cpp's converter gives a Qwen3-Reranker: rank pooling, the labels "yes" and
    "no" and a two-row `cls.output` (for `llama-server --rerank`), with no `output.weight`,
    so llama.cpp builds the output layer from the embeddings. `rank` is an untied model's
    (the rows are random: another head's), `rank-tied` a tied one's (0.6B): the rows are
    the embeddings' rows of "yes" and "no", stored as they are, and the files differ in
    nothing else. Run by the converter's environment (`converted.prepare_speed_twin`):
    nothing of rerank-server is imported here.
    """
    if head not in HEADS:
        raise SystemExit(f"head {head!r}: choose from {', '.join(HEADS)}")
    rng = np.random.default_rng(0)
    writer = GGUFWriter(out, ARCH)
    writer.add_name(f"Qwen3-Reranker-0.6B speed twin ({head}, random weights)")
    writer.add_file_type(7 if kind == "q8_0" else 1)  # MOSTLY_Q8_0, MOSTLY_F16
    writer.add_context_length(40960)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYER)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD_KV)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    tokens = _copy_tokenizer(GGUFReader(tokenizer), writer)
    rank = head != "lm"
    if rank:
        writer.add_pooling_type(PoolingType.RANK)
        writer.add_classifier_output_labels(list(CONVERTER_ANSWERS))
        writer.add_chat_template([{"name": "rerank", "template": RERANK_TEMPLATE}])
    answers = _answers(tokens, rank)
    embd = _anchor(_random(rng, (len(tokens), N_EMBD)), answers)
    _store(writer, "token_embd.weight", embd, kind)
    _tensor(writer, "output_norm.weight", (N_EMBD,), kind, rng, norm=True)
    if rank:
        # Drawn for both heads: every other tensor is the same in the two files.
        rows = _random(rng, (2, N_EMBD))
        _store(writer, "cls.output.weight", embd[answers] if head == "rank-tied" else rows, kind)
    for i in range(N_LAYER):
        b = f"blk.{i}"
        _tensor(writer, f"{b}.attn_norm.weight", (N_EMBD,), kind, rng, norm=True)
        _tensor(writer, f"{b}.attn_q.weight", (N_HEAD * HEAD_DIM, N_EMBD), kind, rng)
        _tensor(writer, f"{b}.attn_k.weight", (N_HEAD_KV * HEAD_DIM, N_EMBD), kind, rng)
        _tensor(writer, f"{b}.attn_v.weight", (N_HEAD_KV * HEAD_DIM, N_EMBD), kind, rng)
        _tensor(writer, f"{b}.attn_output.weight", (N_EMBD, N_HEAD * HEAD_DIM), kind, rng)
        _tensor(writer, f"{b}.attn_q_norm.weight", (HEAD_DIM,), kind, rng, norm=True)
        _tensor(writer, f"{b}.attn_k_norm.weight", (HEAD_DIM,), kind, rng, norm=True)
        _tensor(writer, f"{b}.ffn_norm.weight", (N_EMBD,), kind, rng, norm=True)
        _tensor(writer, f"{b}.ffn_gate.weight", (N_FF, N_EMBD), kind, rng)
        _tensor(writer, f"{b}.ffn_up.weight", (N_FF, N_EMBD), kind, rng)
        _tensor(writer, f"{b}.ffn_down.weight", (N_EMBD, N_FF), kind, rng)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    main(*sys.argv[1:5])
