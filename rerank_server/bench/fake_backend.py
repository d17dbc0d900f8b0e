"""An instant scoring backend for overhead benchmarks, speaking every backend's protocol.

Run as `python -m rerank_server.bench.fake_backend --port 8099`.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
import math
import random
import struct
from typing import Any, cast

import orjson

from ..loops import loop_factory


def _score(text: str) -> float:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "big") / 2**32


# The rest of the 20 top logprobs rerank-server asks for, as llama-server sends them: the
# parsing of every entry is part of what a scored pair costs.
_OTHERS = [
    {"id": 10 + i, "token": t, "bytes": list(t.encode()), "logprob": -12.0 - i}
    for i, t in enumerate(
        (
            " Yes",
            " No",
            "YES",
            "The",
            "Based",
            "I",
            "It",
            "Rel",
            "yes,",
            "No.",
            "\n",
            " ",
            "The",
            "This",
            "A",
            "Maybe",
            "Not",
            "<",
        )
    )
]


def _logprobs(p: float) -> list[dict[str, Any]]:
    return [
        {"id": 1, "token": "yes", "bytes": [121, 101, 115], "logprob": math.log(max(p, 1e-6))},
        {"id": 2, "token": "no", "bytes": [110, 111], "logprob": math.log(max(1 - p, 1e-6))},
        *_OTHERS,
    ]


# An embedding is as long as MiniLM-L6's (384 floats) and written as llama-server writes
# floats, so decoding it costs what a real answer's does: the first three components
# carry the score (the cosine with the query's), the rest are the same tiny values for
# every text (about 1e-7 each: they move a cosine by less than 1e-11).
EMBEDDING_DIMENSIONS = 384
_RANDOM = random.Random(7)
_TAIL = [float(f"{_RANDOM.uniform(-1e-7, 1e-7):.8g}") for _ in range(EMBEDDING_DIMENSIONS - 3)]
_TAIL_BYTES = struct.pack(f"<{len(_TAIL)}f", *_TAIL)


def _embedding(score: float, as_base64: bool) -> list[float] | str:
    if as_base64:  # OpenAI's `encoding_format: base64`: little-endian float32
        return base64.b64encode(struct.pack("<3f", score, 1.0, 0.5) + _TAIL_BYTES).decode()
    return [score, 1.0, 0.5, *_TAIL]


_TIMINGS = {
    "cache_n": 0,
    "prompt_n": 150,
    "prompt_ms": 20.5,
    "prompt_per_token_ms": 0.14,
    "prompt_per_second": 7317.1,
    "predicted_n": 1,
    "predicted_ms": 0.001,
    "predicted_per_token_ms": 0.0,
    "predicted_per_second": 0.0,
}


def answer(path: str, body: Any) -> Any:
    if path == "/v1/chat/completions":
        # The user's message holds the document (the last one may be the assistant's
        # prefill, the same for every pair).
        content = next(m["content"] for m in body["messages"] if m["role"] == "user")
        if "JSON array" in body["messages"][0]["content"]:  # the llm backend
            n = content.count("\n[")
            # One hash of the whole prompt, not one per candidate: a listwise prompt is
            # every document at once, and hashing it 40 times was the fake's main cost.
            seed = _score(content)
            scores = [
                {"index": i, "score": round(_score(f"{i} {seed}"), 3)} for i in range(1, n + 1)
            ]
            return {"choices": [{"message": {"role": "assistant", "content": json.dumps(scores)}}]}
        top = _logprobs(_score(content))
        # Shaped and sized as the pinned llama-server's answer (about 2.2 KB).
        return {
            "created": 1795411458,
            "model": "instant",
            "system_fingerprint": "b0-unknown",
            "object": "chat.completion",
            "id": "chatcmpl-akEur6yhsVIgbXVkyptf8cGLjJNEMXJi",
            "usage": {
                "completion_tokens": 1,
                "prompt_tokens": len(content) // 4,
                "total_tokens": len(content) // 4 + 1,
                "prompt_tokens_details": {"cached_tokens": 0},
            },
            "timings": _TIMINGS,
            "choices": [
                {
                    "finish_reason": "length",
                    "index": 0,
                    "message": {"role": "assistant", "content": "yes"},
                    "logprobs": {"content": [{**top[0], "top_logprobs": top}]},
                }
            ],
        }
    if path == "/completion":
        prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
        return [_completion(i, p, body.get("response_fields")) for i, p in enumerate(prompts)]
    if path == "/tokenize":
        return {"tokens": [1] if body["content"].strip().lower() == "yes" else [2]}
    if path == "/apply-template":
        m = body["messages"]
        return {"prompt": f"<s>{m[0]['content']}\n{m[1]['content']}\n<a>"}
    if path in ("/v1/rerank", "/rerank"):
        if "texts" in body:
            return [{"index": i, "score": _score(t)} for i, t in enumerate(body["texts"])]
        return {
            "results": [
                {"index": i, "relevance_score": _score(t)} for i, t in enumerate(body["documents"])
            ]
        }
    if path == "/v1/embeddings":
        as_base64 = body.get("encoding_format") == "base64"
        data = [
            {
                "embedding": _embedding(_score(t), as_base64),
                "index": i,
                "object": "embedding",
                **({"encoding_format": "base64"} if as_base64 else {}),
            }
            for i, t in enumerate(body["input"])
        ]
        tokens = sum(len(t) // 4 for t in body["input"])
        return {
            "model": "instant",
            "object": "list",
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "data": data,
        }
    if path == "/api/generate":
        # Ollama's whole non-streaming answer (docs.ollama.com/api/usage), not only the
        # two fields the scorer reads: decoding the rest is part of a pair's cost.
        prompt_tokens = len(body["prompt"]) // 4
        return {
            "model": body.get("model", "instant"),
            "created_at": "2026-11-25T07:30:00.000000Z",
            "response": str(round(_score(body["prompt"]) * 10)),
            "done": True,
            "done_reason": "stop",
            "total_duration": 174560334,
            "load_duration": 101397084,
            "prompt_eval_count": prompt_tokens,
            "prompt_eval_duration": 13074791,
            "eval_count": 2,
            "eval_duration": 52479709,
        }
    return None


# What llama-server (the pinned build) adds to each `/completion` result unless
# `response_fields` narrows it: its sampling settings, the prompt echoed, timings. The
# size is part of what decoding an answer costs (159 KB for 40 prompts, 68 KB narrowed).
_SETTINGS = {
    "seed": 4294967295,
    "temperature": 0.0,
    "dynatemp_range": 0.0,
    "dynatemp_exponent": 1.0,
    "top_k": 40,
    "top_p": 0.95,
    "min_p": 0.05,
    "top_n_sigma": -1.0,
    "xtc_probability": 0.0,
    "xtc_threshold": 0.1,
    "typical_p": 1.0,
    "repeat_last_n": 64,
    "repeat_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "dry_multiplier": 0.0,
    "dry_base": 1.75,
    "dry_allowed_length": 2,
    "dry_penalty_last_n": 64,
    "dry_sequence_breakers": ["\n", ":", '"', "*"],
    "mirostat": 0,
    "mirostat_tau": 5.0,
    "mirostat_eta": 0.1,
    "adaptive_target": -1.0,
    "adaptive_decay": 0.9,
    "stop": [],
    "max_tokens": 1,
    "n_predict": 1,
    "n_keep": 0,
    "n_discard": 0,
    "ignore_eos": False,
    "stream": False,
    "logit_bias": [],
    "n_probs": 20,
    "min_keep": 0,
    "grammar": "",
    "grammar_lazy": False,
    "grammar_triggers": [],
    "preserved_tokens": [],
    "chat_format": "Content-only",
    "reasoning_format": "deepseek",
    "reasoning_in_content": False,
    "generation_prompt": "",
    "samplers": [
        "penalties",
        "dry",
        "top_n_sigma",
        "top_k",
        "typ_p",
        "top_p",
        "min_p",
        "xtc",
        "temperature",
    ],
    "speculative.types": "none",
    "timings_per_token": False,
    "post_sampling_probs": False,
    "backend_sampling": False,
    "lora": [],
}


def _completion(index: int, prompt: str, fields: Any) -> dict[str, Any]:
    top = _logprobs(_score(prompt))
    result = {"completion_probabilities": [{**top[0], "top_logprobs": top}], "model": "instant"}
    if fields:
        return {k: v for k, v in result.items() if k in fields}
    n = len(prompt) // 4
    return {
        "index": index,
        "content": "yes",
        "tokens": [],
        "id_slot": index % 4,
        "stop": True,
        "model": "instant",
        "tokens_predicted": 1,
        "tokens_evaluated": n,
        "generation_settings": _SETTINGS,
        "prompt": prompt,
        "has_new_line": False,
        "truncated": False,
        "stop_type": "limit",
        "stopping_word": "",
        "tokens_cached": 0,
        "timings": _TIMINGS,
        "completion_probabilities": result["completion_probabilities"],
    }


# What llama-server's `/props` tells of the context (2048 tokens per slot, as the bench's
# llama-server runs): the scorers cut documents to it, and a 600-character passage fits.
_PROPS = {"default_generation_settings": {"n_ctx": 2048}, "total_slots": 4}
SCORING_PATHS_EXEMPT = ("/tokenize", "/apply-template")  # metadata: never delayed
MAX_HEAD = 64 * 1024


class FakeHttp(asyncio.Protocol):
    """One keep-alive connection: requests with `Content-Length` bodies, answered in order
    (clients send one request at a time per connection), at once or after `latency_s`,
    with scores that are a stable function of the text. Not a test double for
    correctness (tests use `tests/fakes/`).

    `POST /bench/record` starts recording the scoring calls that arrive, on every
    connection, and `GET /bench/recorded` stops and returns them as `[{"path", "body"}]`:
    the overhead benchmark replays one request's calls directly to time the backend alone.
    """

    latency_s = 0.0  # per scoring call
    recorded: list[dict[str, str]] | None = None

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            lines = bytes(self.buffer[:end]).decode("latin-1").split("\r\n")
            length = next(
                (
                    int(value)
                    for name, _, value in (x.partition(":") for x in lines)
                    if name.strip().lower() == "content-length"
                ),
                0,
            )
            if len(self.buffer) < end + 4 + length:
                break
            body = bytes(self.buffer[end + 4 : end + 4 + length])
            del self.buffer[: end + 4 + length]
            method, path = lines[0].split(" ")[:2]
            self.respond(method, path, body)
        if len(self.buffer) > MAX_HEAD and self.transport is not None:
            self.transport.close()

    def respond(self, method: str, path: str, raw: bytes) -> None:
        if method == "GET":
            if path == "/bench/recorded":
                self.send(200, FakeHttp.recorded or [])
                FakeHttp.recorded = None
                return
            self.send(
                200,
                {"data": [{"id": "instant"}]}
                if path == "/v1/models"
                else _PROPS
                if path == "/props"
                else {"status": "ok"},
            )
            return
        if path == "/bench/record":
            FakeHttp.recorded = []
            self.send(200, {"status": "recording"})
            return
        if FakeHttp.recorded is not None and path not in SCORING_PATHS_EXEMPT:
            FakeHttp.recorded.append({"path": path, "body": raw.decode()})
        try:
            payload = answer(path, orjson.loads(raw))
        except (orjson.JSONDecodeError, KeyError, TypeError, StopIteration):
            self.send(400, {"error": "bad request"})
            return
        status, payload = (404, {"error": "not found"}) if payload is None else (200, payload)
        if self.latency_s and path not in SCORING_PATHS_EXEMPT:
            asyncio.get_running_loop().call_later(self.latency_s, self.send, status, payload)
        else:
            self.send(status, payload)

    def send(self, status: int, payload: Any) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        data = orjson.dumps(payload)
        reason = {200: b"OK", 400: b"Bad Request"}.get(status, b"Not Found")
        self.transport.write(
            b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (status, reason, len(data), data)
        )


async def serve(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(FakeHttp, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument(
        "--latency-ms",
        type=float,
        default=0.0,
        help="wait this long before answering each scoring call",
    )
    args = parser.parse_args()
    FakeHttp.latency_s = args.latency_ms / 1000
    with asyncio.Runner(loop_factory=loop_factory()) as runner:  # uvloop where installed
        runner.run(serve(args.port))


if __name__ == "__main__":
    main()
