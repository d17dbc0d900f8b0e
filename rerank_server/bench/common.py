"""What the scenarios share: the passages, percentiles, timing, the default settings."""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

SCENARIOS = ("overhead", "telemetry", "model", "throughput", "streaming", "backends")
# Run only when named: a llama-server per grid cell takes minutes on a CPU.
OPT_IN = ("settings", "completion-options")
GRID = ((1, 512), (2, 512), (4, 512), (4, 2048))
KINDS = ("chat", "completion", "rerank", "embedding", "ollama", "llm")
SIZES = (10, 40, 100)
CLIENTS = (1, 4, 16, 64)
SLOTS = 4
# Where issue 17 set its targets (CPU per pair, added latency, telemetry's share of them).
TELEMETRY_CANDIDATES = 40
WORDS = [
    "river",
    "bank",
    "model",
    "light",
    "engine",
    "garden",
    "market",
    "signal",
    "paper",
    "stone",
    "winter",
    "forest",
    "language",
    "history",
    "system",
    "answer",
    "window",
    "energy",
    "doctor",
    "village",
    "music",
    "animal",
    "station",
    "theory",
    "bridge",
    "number",
    "planet",
    "letter",
    "kitchen",
    "season",
]


def passages(n: int, seed: int = 7, chars: int = 600) -> list[str]:
    """Deterministic English-like passages of about `chars` characters."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words: list[str] = []
        while sum(len(w) + 1 for w in words) < chars:
            words.append(rng.choice(WORDS))
        out.append(" ".join(words).capitalize() + ".")
    return out


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ms_stats(seconds: Sequence[float]) -> dict[str, float]:
    return {
        "p50_ms": round(pct(seconds, 0.5) * 1000, 2),
        "p99_ms": round(pct(seconds, 0.99) * 1000, 2),
    }


async def timed(call: Callable[[], Awaitable[Any]]) -> float:
    started = time.perf_counter()
    await call()
    return time.perf_counter() - started
