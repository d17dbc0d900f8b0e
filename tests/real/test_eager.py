"""`bench`'s physical limit runs the model llama-server runs: the eager decoder
(`bench/eager.py`) over the stand-in's own GGUF picks the same next token as
llama-server does, prompt by prompt, close calls included."""

from __future__ import annotations

import asyncio
import json
import subprocess

import httpx

from rerank_server import settings
from rerank_server.bench import physical
from tests.real.conftest import RealLlama

PROMPTS = [
    "The capital of France is",
    "One, two, three, four,",
    "<|im_start|>user\nIs the sky blue? Answer yes or no.<|im_end|>\n<|im_start|>assistant\n",
    "Monday, Tuesday, Wednesday,",
]


def _llama_next(url: str, tokens: list[int]) -> int:
    answer = httpx.post(
        url + "/completion",
        timeout=60,
        json={"prompt": tokens, "n_predict": 1, "temperature": 0.0, "n_probs": 1},
    ).json()
    return int(answer["completion_probabilities"][0]["id"])


def test_the_eager_decoder_predicts_what_llama_server_predicts(real_llama: RealLlama) -> None:
    python = physical.torch_python(settings.load([]).cache_dir)
    assert python is not None, "no converter environment: run `make test-assets`"

    async def tokenize() -> list[list[int]]:
        async with httpx.AsyncClient(timeout=30) as http:
            return await physical.prompt_tokens(http, real_llama.url, PROMPTS)

    tokens = asyncio.run(tokenize())
    assert tokens[2].count(1) == 2  # `<|im_start|>` parsed as the special token it is

    done = subprocess.run(
        [str(python), str(physical.SCRIPT), str(real_llama.model), "--argmax"],
        input=json.dumps(tokens),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    eager = json.loads(done.stdout.strip().splitlines()[-1])["argmax"]
    assert eager == [_llama_next(real_llama.url, t) for t in tokens]
