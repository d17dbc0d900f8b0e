"""`rerank-server fit` end to end: two data sets evaluated through a real in-process server
(against the fake llama-server), a profile fitted across them from the eval outputs, and
the server, loaded with it, ranks exactly as the fit reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rerank_server.evaluation import fit_command
from rerank_server.evaluation.run import main as eval_main
from tests.fakes.llama import FakeLlamaServer
from tests.tools.test_eval import write_dataset


def test_fit_across_data_sets_then_serve_with_the_profile(
    tmp_path: Path, fake_llama: FakeLlamaServer
) -> None:
    fake_llama.scores = {"GOOD": 0.95}
    fake_llama.default_score = 0.05
    server = f"--backend-url {fake_llama.url} --no-probe --metrics-port 0"
    out, profiles = tmp_path / "out", tmp_path / "profiles.json"
    common = ["--depth", "6", "--rerank-depth", "6", "--out", str(out)]
    for name in ("tiny", "small"):
        data = write_dataset(tmp_path / name, header=True)
        assert eval_main([str(data), "--server", server, "--blend", "rerank_only", *common]) == 0

    evals = [str(out / "eval-tiny.json"), str(out / "eval-small.json")]
    assert (
        fit_command.main(
            [
                *evals,
                "--out",
                str(out),
                "--fit-profile",
                str(profiles),
                "--profile-name",
                "fake",
                "--profile-model",
                "fake-*",
            ]
        )
        == 0
    )
    report = json.loads((out / "fit-fake.json").read_text())
    assert set(report["collections"]) == {"tiny", "small"}
    tiny = report["collections"]["tiny"]
    assert tiny["held_out"]["fitted_on"] == ["small"]
    assert set(tiny["fitted_on_all"]["fitted_on"]) == {"tiny", "small"}
    assert tiny["fitted_on_all"]["ndcg@10"] > tiny["bm25"]  # a decisive scorer is trusted
    assert "| tiny | 3 |" in (out / "fit-fake.md").read_text()
    written = json.loads(profiles.read_text())["profiles"]
    assert [(p["name"], p["backend"], p["model"]) for p in written] == [("fake", "chat", "fake-*")]
    assert set(written[0]["fitted"]["collections"]) == {"tiny", "small"}

    for name in ("tiny", "small"):
        assert (
            eval_main(
                [
                    str(tmp_path / name),
                    "--server",
                    f"{server} --blend-profile {profiles}",
                    "--blend",
                    "profile",
                    "--name",
                    f"{name}-again",
                    *common,
                ]
            )
            == 0
        )
        again = json.loads((out / f"eval-{name}-again.json").read_text())
        assert again["blended_by"] == {"profile": "profile fake"}
        assert again["means"]["profile"]["ndcg@10"] == pytest.approx(
            report["collections"][name]["fitted_on_all"]["ndcg@10"], abs=1e-4
        )


def test_fit_refuses_inputs_it_cannot_use_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    scored = {"q1": {"ids": ["a", "b"], "ranks": [1, 2], "scores": [0.2, 0.9], "rest": []}}

    def write(name: str, **fields: object) -> str:
        body = {
            "dataset": name,
            "backend": "chat",
            "model": "m",
            "scored": scored,
            "qrels": {"q1": {"b": 1}},
            **fields,
        }
        (tmp_path / f"{name}.json").write_text(json.dumps(body))
        return str(tmp_path / f"{name}.json")

    cases = [
        ([write("a"), write("b", model="other")], "different backends or models"),
        ([write("a"), write("a")], "a data set is given twice"),
        ([write("c", scored={})], "no reranked queries with judgements"),
        ([str(tmp_path / "missing.json")], "cannot read it as JSON"),
    ]
    for argv, message in cases:
        assert fit_command.main([*argv, "--out", str(tmp_path / "out")]) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith("rerank-server fit: error:") and message in err
        assert len(err.splitlines()) == 1
