"""`rerank-server eval` end to end on a tiny data set the test writes: BM25, reranking by
a real in-process server against the fake llama-server, ranx metrics, JSON and Markdown."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rerank_server.evaluation import beir
from rerank_server.evaluation.first_stage import bm25_top
from rerank_server.evaluation.needle import SIZE, needles
from rerank_server.evaluation.run import main
from tests.fakes.llama import FakeLlamaServer

# Per query: the judged-relevant document says less (BM25 ranks it low); the fake
# backend knows it by its marker and scores it high.
TOPICS = {
    "q1": ("apple orchard harvest", "apple orchard harvest apple orchard apple"),
    "q2": ("river bridge repair", "river bridge repair river bridge river"),
    "q3": ("violin string tuning", "violin string tuning violin string violin"),
}


def write_beir(
    root: Path, corpus: list[dict[str, str]], queries: list[dict[str, str]], qrels: list[str]
) -> Path:
    """A data set in BEIR layout under `root`."""
    root.mkdir()
    (root / "corpus.jsonl").write_text("\n".join(json.dumps(d) for d in corpus) + "\n")
    (root / "queries.jsonl").write_text("\n".join(json.dumps(q) for q in queries) + "\n")
    (root / "qrels.tsv").write_text("\n".join(qrels) + "\n")
    return root


def write_dataset(root: Path, header: bool) -> Path:
    corpus, queries, qrels = [], [], ["query-id\tcorpus-id\tscore"] if header else []
    for qid, (query, keyword_stuffed) in TOPICS.items():
        queries.append({"_id": qid, "text": query})
        corpus.append({"_id": f"{qid}-stuffed", "title": "", "text": keyword_stuffed})
        corpus.append(
            {
                "_id": f"{qid}-good",
                "title": "Guide",
                "text": f"GOOD answer: a short {query.split()[0]} guide",
            }
        )
        qrels.append(f"{qid}\t{qid}-good\t2")
        for i in range(4):
            corpus.append(
                {
                    "_id": f"{qid}-noise{i}",
                    "title": "",
                    "text": f"{query.split()[1]} filler text number {i}",
                }
            )
    queries.append({"_id": "unjudged", "text": "no judgements for this one"})
    return write_beir(root, corpus, queries, qrels)


@pytest.mark.parametrize("header", [True, False])
def test_loader_reads_beir_with_or_without_header(tmp_path: Path, header: bool) -> None:
    data = beir.load(write_dataset(tmp_path / "tiny", header))
    assert set(data.queries) == {"q1", "q2", "q3"}  # the unjudged query is left out
    assert data.qrels["q1"] == {"q1-good": 2}
    assert len(data.corpus) == 18


def test_eval_measures_bm25_and_each_strategy(tmp_path: Path, fake_llama: FakeLlamaServer) -> None:
    fake_llama.scores = {"GOOD": 0.95}
    fake_llama.default_score = 0.05
    data = write_dataset(tmp_path / "tiny", header=True)
    out = tmp_path / "out"
    code = main(
        [
            str(data),
            "--server",
            f"--backend-url {fake_llama.url} --no-probe --metrics-port 0",
            "--depth",
            "6",
            "--rerank-depth",
            "6",
            "--blend",
            "rerank_only,position_aware",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    result = json.loads((out / "eval-tiny.json").read_text())
    means = result["means"]
    assert set(means) == {"bm25", "rerank_only", "position_aware"}
    # BM25 puts the keyword-stuffed document first; the reranker puts the good one first.
    assert means["bm25"]["mrr@10"] < 1.0
    assert means["rerank_only"]["mrr@10"] == 1.0
    assert means["rerank_only"]["ndcg@10"] > means["bm25"]["ndcg@10"]
    assert set(result["per_query"]["rerank_only"]["ndcg@10"]) == {"q1", "q2", "q3"}
    assert result["requests"]["rerank_only"] == {
        "reranked": 3,
        "degraded": 0,
        "no_reranker_weight": 0,
        "failed_pairs": 0,
    }
    assert result["backend"] == "chat"
    q1 = result["scored"]["q1"]  # the raw scores, for fits across data sets
    assert q1["scores"][q1["ids"].index("q1-good")] == pytest.approx(0.95)
    table = (out / "eval-tiny.md").read_text()
    assert "| a | bm25 |" in table and "rerank_only" in table and "ndcg@10" in table


def test_fit_profile_then_evaluate_with_it(tmp_path: Path, fake_llama: FakeLlamaServer) -> None:
    """Fit a profile on one run, load it into a server, and get what the fit promised:
    the offline replay and the server blend the same way."""
    fake_llama.scores = {"GOOD": 0.95}
    fake_llama.default_score = 0.05
    data = write_dataset(tmp_path / "tiny", header=True)
    profiles, out = tmp_path / "profiles.json", tmp_path / "out"
    server = f"--backend-url {fake_llama.url} --no-probe --metrics-port 0"
    common = ["--depth", "6", "--rerank-depth", "6", "--out", str(out)]
    assert (
        main(
            [
                str(data),
                "--server",
                server,
                "--blend",
                "rerank_only",
                *common,
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
    fitted = json.loads((out / "eval-tiny.json").read_text())
    written = json.loads(profiles.read_text())["profiles"]
    assert [(p["name"], p["backend"], p["model"]) for p in written] == [("fake", "chat", "fake-*")]
    assert written[0]["max_weight"] > 0  # a decisive scorer is trusted
    assert written[0]["fitted"]["dataset"] == "tiny" and written[0]["fitted"]["queries"] == 3
    assert "profile_cv" in fitted["means"]
    in_sample = written[0]["fitted"]["ndcg@10"]["in_sample"]

    assert (
        main(
            [
                str(data),
                "--server",
                f"{server} --blend-profile {profiles}",
                "--blend",
                "profile,adaptive",
                "--name",
                "again",
                *common,
            ]
        )
        == 0
    )
    again = json.loads((out / "eval-again.json").read_text())
    assert again["blended_by"] == {"profile": "profile fake", "adaptive": "adaptive"}
    assert again["means"]["profile"]["ndcg@10"] == pytest.approx(in_sample, abs=1e-4)
    # Per-query values belong to their queries (ranx orders queries its own way).
    per_query = again["per_query"]["bm25"]["ndcg@10"]
    bm25 = again["means"]["bm25"]["ndcg@10"]
    assert sum(per_query.values()) / 3 == pytest.approx(bm25)
    table = (out / "eval-again.md").read_text()
    assert "share of rerank gain" in table and "profile as `profile fake`" in table


def test_a_run_with_no_pair_scored_fails_with_one_line(
    tmp_path: Path,
    fake_llama: FakeLlamaServer,
    capsys: pytest.CaptureFixture[str],
) -> None:
    port = fake_llama.kill()  # nothing listens there: every pair fails
    data = write_dataset(tmp_path / "tiny", header=True)
    code = main(
        [
            str(data),
            "--server",
            f"--backend-url http://127.0.0.1:{port} --no-probe --metrics-port 0",
            "--depth",
            "6",
            "--rerank-depth",
            "6",
            "--blend",
            "rerank_only",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 1
    assert [line for line in err.splitlines() if "error:" in line] == [
        next(line for line in err.splitlines() if "no pair was scored" in line)
    ]
    assert not (tmp_path / "out" / "eval-tiny.md").exists()


def test_a_profile_that_needs_no_scores_is_a_result_not_a_failure(
    tmp_path: Path, fake_llama: FakeLlamaServer
) -> None:
    """A profile that gives the model no weight answers in BM25 order without scoring: the
    evaluation reports that, instead of calling the run one in which nothing worked."""
    profiles = tmp_path / "profiles.json"
    profiles.write_text(
        json.dumps(
            {
                "profiles": [
                    {"name": "ignore-fake", "backend": "chat", "model": "fake-*", "max_weight": 0.0}
                ]
            }
        )
    )
    data = write_dataset(tmp_path / "tiny", header=True)
    out = tmp_path / "out"
    assert (
        main(
            [
                str(data),
                "--server",
                f"--backend-url {fake_llama.url} --metrics-port 0 --blend-profile {profiles}",
                "--depth",
                "6",
                "--rerank-depth",
                "6",
                "--blend",
                "profile",
                "--concurrency",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads((out / "eval-tiny.json").read_text())
    counts = result["requests"]["profile"]
    # Requests sent before the backend named its model are scored (the profile is matched
    # by that name), and blended by the profile all the same; later ones are not sent.
    assert counts["reranked"] + counts["no_reranker_weight"] == 3
    assert counts["no_reranker_weight"] >= 1 and counts["degraded"] == 0
    assert result["means"]["profile"]["ndcg@10"] == result["means"]["bm25"]["ndcg@10"]


def test_unknown_blend_is_an_argument_error_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "missing"), "--blend", "rerank_only,magic"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert (
        "unknown strategy magic; choose from position_aware, linear, rerank_only, "
        "adaptive, profile" in err
    )


def test_defaults_include_profile_and_help_shows_them(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # as wrapped for the terminal
    assert "(default: position_aware,linear,rerank_only,adaptive,profile)" in out
    assert "(default: 100)" in out  # --depth


def test_json_has_no_bare_nan_and_time_is_the_whole_run(
    tmp_path: Path, fake_llama: FakeLlamaServer
) -> None:
    """A blend that keeps BM25's order gives identical runs, whose p-value ranx reports as
    NaN: the file must still be valid JSON."""
    fake_llama.default_score = 0.5  # no signal: position_aware keeps BM25's ranking
    data = write_dataset(tmp_path / "tiny", header=True)
    out = tmp_path / "out"
    assert (
        main(
            [
                str(data),
                "--server",
                f"--backend-url {fake_llama.url} --no-probe --metrics-port 0",
                "--depth",
                "6",
                "--rerank-depth",
                "6",
                "--blend",
                "position_aware",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    text = (out / "eval-tiny.json").read_text()
    result = json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in JSON"))
    assert result["p_values"]["bm25"]["position_aware"]["ndcg@10"] is None
    assert result["seconds"] > 0


def needle_dataset(root: Path, graded: bool) -> Path:
    """Two queries of 25 documents on their topic; one judged relevant (it says GOOD).
    Graded: the rest judged 0 (as TREC DL); else unjudged (as Vaswani)."""
    corpus, queries, qrels = [], [], []
    for qid, topic in (("q1", "apple orchard"), ("q2", "river bridge")):
        queries.append({"_id": qid, "text": topic})
        corpus.append({"_id": f"{qid}-good", "title": "", "text": f"GOOD {topic}"})
        qrels.append(f"{qid}\t{qid}-good\t2")
        for i in range(24):
            corpus.append({"_id": f"{qid}-n{i}", "title": "", "text": f"{topic} {topic} {i}"})
            if graded:
                qrels.append(f"{qid}\t{qid}-n{i}\t0")
    return write_beir(root, corpus, queries, qrels)


@pytest.mark.parametrize("graded", [True, False])
def test_needle_requests_hide_a_relevant_document_in_the_second_half(
    tmp_path: Path, graded: bool
) -> None:
    data = beir.load(needle_dataset(tmp_path / "n", graded))
    cases = needles(data, bm25_top(data, 30))
    assert [c.qid for c in cases] == ["q1", "q2"]
    for case in cases:
        assert len(case.documents) == SIZE and 11 <= case.position <= 20
        others = [d.id for d in case.documents if d.id != case.needle]
        assert case.needle.endswith("-good") and all("-n" in d for d in others)
        assert others == sorted(
            others, key=lambda d: [h.document.id for h in bm25_top(data, 30)[case.qid]].index(d)
        )
    assert needles(data, bm25_top(data, 30)) == cases  # the same positions every run


def test_eval_needle_reports_each_strategy_against_rerank_only(
    tmp_path: Path, fake_llama: FakeLlamaServer
) -> None:
    fake_llama.scores = {"GOOD": 0.95}
    fake_llama.default_score = 0.3
    data = needle_dataset(tmp_path / "n", graded=True)
    out = tmp_path / "out"
    code = main(
        [
            str(data),
            "--server",
            f"--backend-url {fake_llama.url} --no-probe --metrics-port 0",
            "--depth",
            "30",
            "--blend",
            "rerank_only,position_aware,adaptive",
            "--needle",
            "--needle-sizes",
            f"{SIZE},25",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    result = json.loads((out / "eval-n.json").read_text())
    needle = result["needle"]
    assert needle["queries"] == 2
    assert needle["rates"]["rerank_only"] == 1.0 and needle["rates"]["adaptive"] == 1.0
    scored = needle["scored"]["q1"]
    assert scored["script"] == "Latin" and len(scored["scores"]) == SIZE
    longer = result["needles"]["25"]
    assert longer["queries"] == 2 and longer["rates"]["adaptive"] == 1.0
    table = (out / "eval-n.md").read_text()
    assert f"Needle case at {SIZE} candidates (2 queries" in table
    assert "Needle case at 25 candidates (2 queries" in table
