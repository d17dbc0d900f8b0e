"""Blend profiles through a real server: chosen by backend and model, named in answers,
selectable per request and server-wide, refused at start when the file is bad."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from rerank_client import AsyncRerankClient, Candidate, Result, Summary

from rerank_server.domain import BlendStrategy
from rerank_server.errors import ConfigError
from rerank_server.server import RunningServer, build_server
from rerank_server.settings import Settings
from tests.conftest import StartServer, client_of
from tests.fakes.llama import FakeLlamaServer

# Retrieval order a, b, c, d; the reranker says the opposite, decisively.
DOCS = [Candidate(id=x, text=f"{x} text") for x in "abcd"]
SCORES = {"a text": 0.05, "b text": 0.3, "c text": 0.6, "d text": 0.95}


def profile(name: str, model: str, weight: float) -> dict[str, Any]:
    return {
        "name": name,
        "backend": "chat",
        "model": model,
        "spread_noise": 0.0,
        "spread_decisive": 0.0,
        "min_weight": weight,
        "max_weight": weight,
    }


@pytest.fixture
def profiles(tmp_path: Path) -> Path:
    path = tmp_path / "profiles.json"
    path.write_text(
        json.dumps(
            {
                "profiles": [
                    profile(
                        "fake-ignored", "fake-reranker*", 0.0
                    ),  # the fake's model: "fake-reranker.gguf"
                    profile("other-trusted", "other-*", 1.0),
                ]
            }
        )
    )
    return path


async def started(
    start_server: StartServer, fake: FakeLlamaServer, **overrides: Any
) -> tuple[RunningServer, AsyncRerankClient]:
    fake.scores = SCORES
    running = await start_server(**overrides)
    await asyncio.wait_for(running.monitor.ready.wait(), 5)  # the model's name is known
    return running, client_of(running)


async def test_profile_for_the_served_model_blends_and_is_named(
    start_server: StartServer, fake_llama: FakeLlamaServer, profiles: Path
) -> None:
    _, client = await started(start_server, fake_llama, blend_profile=str(profiles))
    async with client:
        sent_before = len(fake_llama.documents())  # the health probe's
        answer = await client.rerank("q", DOCS, blend_strategy="profile")
        assert answer.summary.blend_strategy == "profile"
        assert answer.summary.blend_profile == "fake-ignored"
        # That profile gives the reranker no weight: the retrieval order stands, and no
        # pair is sent, which the answer says.
        assert [r.id for r in answer.results] == ["a", "b", "c", "d"]
        assert len(fake_llama.documents()) == sent_before
        assert answer.results[0].reranker_score is None
        assert answer.summary.degraded_code == "no_reranker_weight"
        assert "fake-ignored gives the reranker no weight" in str(answer.summary.degraded_message)
        # Callers who want the model's scores ask for them: same order, scores present.
        scored = await client.rerank("q", DOCS, blend_strategy="profile", always_score=True)
        assert [r.id for r in scored.results] == ["a", "b", "c", "d"]
        assert scored.results[0].reranker_score == pytest.approx(0.05, abs=1e-3)
        assert scored.summary.degraded_code is None and scored.summary.reranked
        # Other strategies are unaffected and name no profile.
        only = await client.rerank("q", DOCS, blend_strategy="rerank_only")
        assert [r.id for r in only.results] == ["d", "c", "b", "a"]
        assert only.summary.blend_profile == ""
        # The stream blends the same way and says so in its summary.
        streamed = [item async for item in client.stream("q", DOCS, blend_strategy="profile")]
        results = [item for item in streamed if isinstance(item, Result)]
        summary = streamed[-1]
        assert [r.id for r in results] == ["a", "b", "c", "d"]
        assert isinstance(summary, Summary) and summary.blend_profile == "fake-ignored"


async def test_without_a_profile_for_the_model_the_adaptive_blend_answers(
    start_server: StartServer, fake_llama: FakeLlamaServer, tmp_path: Path
) -> None:
    path = tmp_path / "profiles.json"
    path.write_text(json.dumps({"profiles": [profile("other-trusted", "other-*", 0.0)]}))
    _, client = await started(start_server, fake_llama, blend_profile=str(path))
    async with client:
        answer = await client.rerank("q", DOCS, blend_strategy="profile")
    assert answer.summary.blend_strategy == "adaptive"
    assert answer.summary.blend_profile == ""
    # Spread 0.34 is decisive for the built-in adaptive blend: the reranker's order.
    assert [r.id for r in answer.results] == ["d", "c", "b", "a"]


async def test_profile_as_the_server_default(
    start_server: StartServer, fake_llama: FakeLlamaServer, tmp_path: Path
) -> None:
    path = tmp_path / "profiles.json"
    path.write_text(json.dumps({"profiles": [profile("fake-trusted", "fake-*", 1.0)]}))
    _, client = await started(
        start_server, fake_llama, blend_profile=str(path), blend_strategy=BlendStrategy.PROFILE
    )
    async with client:
        answer = await client.rerank("q", DOCS)  # no strategy: the server's default
        pinned = await client.rerank("q", DOCS, blend_strategy="position_aware")
    assert (answer.summary.blend_strategy, answer.summary.blend_profile) == (
        "profile",
        "fake-trusted",
    )
    assert [r.id for r in answer.results] == ["d", "c", "b", "a"]
    assert (pinned.summary.blend_strategy, pinned.summary.blend_profile) == ("position_aware", "")


async def test_a_bad_profile_file_stops_the_server_from_starting(
    fake_llama: FakeLlamaServer, tmp_path: Path
) -> None:
    path = tmp_path / "profiles.json"
    path.write_text(json.dumps({"profiles": [profile("p", "m", 2.0)]}))
    settings = Settings(
        port=0,
        backend_url=fake_llama.url,
        probe=False,
        metrics_port=0,
        http_port=0,
        blend_profile=str(path),
    )
    with pytest.raises(ConfigError, match=r"profiles\[0\].*max_weight <= 1"):
        await build_server(settings)


async def test_a_profile_gives_no_weight_to_text_its_model_cannot_read(
    start_server: StartServer, fake_llama: FakeLlamaServer, tmp_path: Path
) -> None:
    """A profile for a model that reads the Latin script: an English request follows the
    model; an Arabic one keeps the retrieval order, sends no pair, and says why."""
    path = tmp_path / "profiles.json"
    path.write_text(
        json.dumps(
            {"profiles": [{**profile("latin-reader", "fake-reranker*", 1.0), "scripts": ["Latin"]}]}
        )
    )
    _, client = await started(start_server, fake_llama, blend_profile=str(path))
    async with client:
        english = await client.rerank("q", DOCS, blend_strategy="profile")
        assert [r.id for r in english.results] == ["d", "c", "b", "a"]
        sent = len(fake_llama.documents())
        arabic = [Candidate(id=x, text=f"نص عربي عن الموضوع رقم {x}") for x in "abcd"]
        answer = await client.rerank("ما هو الموضوع؟", arabic, blend_strategy="profile")
        assert [r.id for r in answer.results] == ["a", "b", "c", "d"]
        assert len(fake_llama.documents()) == sent
        assert answer.summary.degraded_code == "no_reranker_weight"
        assert "on text in Arabic script (its model reads Latin)" in str(
            answer.summary.degraded_message
        )
