"""Blend profile files: the shipped ones, matching by backend and model, clear errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rerank_server.errors import ConfigError
from rerank_server.ranking import blend_profiles
from rerank_server.ranking.blending import AdaptiveParams


def entry(**overrides: Any) -> dict[str, Any]:
    base = {
        "name": "p",
        "backend": "embedding",
        "model": "all-MiniLM-L6-v2*",
        "spread_noise": 0.05,
        "spread_decisive": 0.08,
        "min_weight": 0.0,
        "max_weight": 0.75,
    }
    return {**base, **overrides}


def write(tmp_path: Path, document: Any) -> Path:
    path = tmp_path / "profiles.json"
    path.write_text(json.dumps(document))
    return path


def test_shipped_profiles_cover_the_two_measured_models() -> None:
    shipped = blend_profiles.load()
    minilm = shipped.find("embedding", "all-MiniLM-L6-v2.f16.gguf")
    standin = shipped.find("chat", "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert minilm is not None and standin is not None
    # Fitted across collections by `rerank-server fit`, not hand-written: each says on
    # what, and how it did on each collection fitted and held out.
    for profile in (minilm, standin):
        collections = profile.fitted["collections"]
        assert {"trec_dl19_passage_subset", "vaswani_npl"} <= {c.split("@")[0] for c in collections}
        assert all(c["queries"] > 0 and c["held_out"] is not None for c in collections.values())
    # MiniLM is fitted at two reranking depths, each a collection (`NAME@DEPTH`).
    assert {"arcd_arabic@20", "arcd_arabic@100"} <= set(minilm.fitted["collections"])
    # The stand-in has no signal: its profile leaves the retrieval order alone. MiniLM is
    # trusted by its spread on text in the Latin script, and not at all on Arabic.
    assert standin.params.max_weight == 0.0
    assert minilm.params.max_weight == 1.0 and minilm.scripts == ("Latin",)
    assert minilm.reads("Latin") and not minilm.reads("Arabic")
    needle = {
        f"{c}@{depth}": minilm.fitted["collections"][f"{c}@{depth}"]["needle"]
        for c in ("trec_dl19_passage_subset", "vaswani_npl")
        for depth in (20, 100)
    }
    assert all(n["fitted_on_all"] >= 0.9 * n["rerank_only"] for n in needle.values())
    assert shipped.find("chat", "Qwen3-Reranker-0.6B.Q8_0.gguf") is None


def test_matching_needs_the_backend_and_the_model_pattern(tmp_path: Path) -> None:
    profiles = blend_profiles.load(
        write(
            tmp_path,
            {
                "profiles": [
                    entry(name="first"),
                    entry(name="second", model="*"),
                    entry(name="chat", backend="chat", model="*"),
                ]
            },
        )
    )

    def name(backend: str, model: str) -> str | None:
        found = profiles.find(backend, model)
        return found.name if found else None

    assert name("embedding", "all-MiniLM-L6-v2.Q8_0.gguf") == "first"  # first match wins
    assert name("embedding", "bge-small") == "second"
    assert name("chat", "anything") == "chat"
    assert name("rerank", "anything") is None
    assert name("embedding", "") is None  # model not known yet: no guess


def test_written_profiles_read_back_the_same(tmp_path: Path) -> None:
    profile = blend_profiles.BlendProfile(
        "x", "chat", "m*", AdaptiveParams(0.01, 0.02, 0.25, 1.0), {"dataset": "d"}
    )
    merged = blend_profiles.BlendProfiles((), "new").with_profile(profile)
    again = blend_profiles.load(write(tmp_path, merged.to_json()))
    assert again.profiles == (profile,)
    # Replacing by name keeps the others and puts the new one first.
    other = blend_profiles.BlendProfile("y", "chat", "*", AdaptiveParams())
    both = again.with_profile(other).with_profile(profile)
    assert [p.name for p in both.profiles] == ["x", "y"]


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ([], 'expected an object with a "profiles" list'),
        ({"profiles": [entry(name="")]}, "profiles[0].name: a non-empty string is required"),
        ({"profiles": [entry(backend=3)]}, "profiles[0].backend: a non-empty string"),
        ({"profiles": [entry(max_weight="high")]}, "profiles[0].max_weight: a number is required"),
        ({"profiles": [entry(min_weight=0.8, max_weight=0.5)]}, "min_weight <= max_weight"),
        (
            {"profiles": [entry(spread_noise=0.2, spread_decisive=0.1)]},
            "spread_noise <= spread_decisive",
        ),
        ({"profiles": [entry(top_floor=0.8, top_full=0.5)]}, "0 <= top_floor <= top_full <= 1"),
        ({"profiles": [entry(), entry(weight=1)]}, "profiles[1]: unknown field 'weight'"),
        ({"profiles": [entry(), entry()]}, "profiles[1].name: 'p' is used twice"),
        ({"profiles": [entry(fitted=[])]}, "profiles[0].fitted: expected an object"),
    ],
)
def test_bad_files_are_refused_naming_the_field(
    tmp_path: Path, document: Any, message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        blend_profiles.load(write(tmp_path, document))
    assert message in str(caught.value)
    assert "--blend-profile / RERANK_BLEND_PROFILE" in str(caught.value)


def test_unreadable_or_non_json_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        blend_profiles.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{profiles:")
    with pytest.raises(ConfigError, match="is not JSON"):
        blend_profiles.load(tmp_path / "bad.json")
