"""The same weights in eager PyTorch: what the hardware gives a decoder reranker.

Run as `python eager.py MODEL.gguf {ROUNDS [BATCH] | --argmax} < tokens.json`.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize


def _weights(
    path: str, dtype: torch.dtype, device: str
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    reader = GGUFReader(path)
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    config: dict[str, float] = {}
    for key, name in (
        ("block_count", "layers"),
        ("attention.head_count", "heads"),
        ("attention.head_count_kv", "kv_heads"),
        ("rope.freq_base", "rope"),
        ("attention.layer_norm_rms_epsilon", "eps"),
    ):
        field = reader.fields.get(f"{arch}.{key}")
        if field is not None:
            config[name] = float(field.parts[-1][0])
    # llama.cpp rotates a llama's query and key in adjacent pairs (the converter permutes
    # their rows for it), a qwen's in halves ("neox").
    config["neox"] = float(arch.startswith("qwen"))
    config.setdefault("rope", 10000.0)
    config.setdefault("eps", 1e-6)
    config.setdefault("kv_heads", config["heads"])
    weights = {}
    for tensor in reader.tensors:
        array = np.array(dequantize(tensor.data, tensor.tensor_type))  # off the memory map
        weights[tensor.name] = torch.from_numpy(array).to(device=device, dtype=dtype)
    return weights, config


class Decoder:
    """A llama-family decoder (llama, qwen3: per-head q/k norms when the GGUF has them),
    as plain tensor operations."""

    def __init__(self, weights: dict[str, torch.Tensor], config: dict[str, float]) -> None:
        self.w = weights
        self.layers = int(config["layers"])
        self.heads, self.kv_heads = int(config["heads"]), int(config["kv_heads"])
        self.eps = config["eps"]
        self.head_dim = weights["blk.0.attn_q.weight"].shape[0] // self.heads
        self.rope_base, self.neox = config["rope"], bool(config["neox"])
        # Tied embeddings: no `output.weight`.
        self.head = weights.get("output.weight", weights["token_embd.weight"])

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, self.eps)

    def _rope(
        self, length: int, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        half = self.head_dim // 2
        freqs = self.rope_base ** (-torch.arange(half, device=device, dtype=torch.float64) / half)
        angles = torch.outer(torch.arange(length, device=device, dtype=torch.float64), freqs)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.neox:
            first, second = x.chunk(2, dim=-1)
        else:
            first, second = x[..., 0::2], x[..., 1::2]
        turned = (first * cos - second * sin, first * sin + second * cos)
        if self.neox:
            return torch.cat(turned, dim=-1)
        return torch.stack(turned, dim=-1).flatten(-2)

    def last_logits(
        self, ids: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor:
        """The `rows` logits at each sequence's last real token."""
        w = self.w
        batch, length = ids.shape
        x = w["token_embd.weight"][ids]
        cos, sin = self._rope(length, x.device, x.dtype)
        for i in range(self.layers):
            p = f"blk.{i}."
            h = self._norm(x, w[p + "attn_norm.weight"])
            q = (h @ w[p + "attn_q.weight"].T).view(batch, length, self.heads, -1)
            k = (h @ w[p + "attn_k.weight"].T).view(batch, length, self.kv_heads, -1)
            v = (h @ w[p + "attn_v.weight"].T).view(batch, length, self.kv_heads, -1)
            if p + "attn_q_norm.weight" in w:
                q = self._norm(q, w[p + "attn_q_norm.weight"])
                k = self._norm(k, w[p + "attn_k_norm.weight"])
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
            attended = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=True
            )
            x = (
                x
                + attended.transpose(1, 2).reshape(batch, length, -1)
                @ w[p + "attn_output.weight"].T
            )
            h = self._norm(x, w[p + "ffn_norm.weight"])
            gated = torch.nn.functional.silu(h @ w[p + "ffn_gate.weight"].T) * (
                h @ w[p + "ffn_up.weight"].T
            )
            x = x + gated @ w[p + "ffn_down.weight"].T
        last = x[torch.arange(batch, device=x.device), lengths - 1]
        return self._norm(last, w["output_norm.weight"]) @ self.head[rows].T


def _pass(model: Decoder, prompts: list[list[int]], batch: int, device: str) -> None:
    rows = torch.tensor([0, 1], device=device)
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        longest = max(len(p) for p in chunk)
        ids = torch.zeros((len(chunk), longest), dtype=torch.long)
        for n, prompt in enumerate(chunk):
            ids[n, : len(prompt)] = torch.tensor(prompt)
        lengths = torch.tensor([len(p) for p in chunk], device=device)
        model.last_logits(ids.to(device), lengths, rows).float().cpu()


def _argmax(model: Decoder, prompts: list[list[int]], device: str) -> list[int]:
    rows = torch.arange(model.head.shape[0], device=device)
    return [
        int(
            model.last_logits(
                torch.tensor([p], device=device), torch.tensor([len(p)], device=device), rows
            ).argmax()
        )
        for p in prompts
    ]


def main(argv: list[str]) -> int:
    """stdin: every pair's prompt as token ids (a JSON list of lists). stdout: one JSON
    object, the device, the dtype and the median pairs/s over ROUNDS passes after a
    warm-up; with `--argmax`, each prompt's most likely next token over the whole head
    (the check that this is the model llama.cpp runs).

    A pass runs every prompt once through the decoder (a llama or qwen3 GGUF,
    dequantized), shortest first in batches of BATCH, right-padded, and reads two logits
    at the last token: a reranker's work per pair and nothing else (no KV cache, no
    sampling, no server). Run by a Python with torch, numpy and llama.cpp's `gguf` (the
    converter's environment); never imported by rerank-server.
    """
    path = argv[1]
    prompts = json.load(sys.stdin)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    # bf16 is what the tensor cores run; a CPU without AMX runs float32 matrix products
    # fastest.
    dtype = torch.bfloat16 if cuda else torch.float32
    model = Decoder(*_weights(path, dtype, device))
    if argv[2] == "--argmax":
        with torch.inference_mode():
            print(json.dumps({"argmax": _argmax(model, prompts, device)}))
        return 0
    rounds = int(argv[2])
    batch = int(argv[3]) if len(argv) > 3 else 32
    prompts.sort(key=len)
    times = []
    with torch.inference_mode():
        for r in range(rounds + 1):
            started = time.perf_counter()
            _pass(model, prompts, batch, device)
            if cuda:
                torch.cuda.synchronize()
            if r:  # the first pass warms up
                times.append(time.perf_counter() - started)
    seconds = statistics.median(times)
    name = torch.cuda.get_device_name() if cuda else f"cpu, {torch.get_num_threads()} threads"
    print(
        json.dumps(
            {
                "device": name,
                "dtype": str(dtype).removeprefix("torch."),
                "batch": batch,
                "pairs": len(prompts),
                "rounds": rounds,
                "tokens": sum(map(len, prompts)),
                "ms": round(seconds * 1000),
                "pairs_per_s": round(len(prompts) / seconds, 1),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
