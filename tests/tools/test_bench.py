"""`rerank-server bench` runs every scenario and writes what it promises. A tiny run:
these check the tool, not the figures (docs/benchmarks.md has those)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from rerank_server.bench import replay
from rerank_server.bench.common import KINDS
from rerank_server.bench.common import passages as make_passages
from rerank_server.bench.processes import fake_backend
from rerank_server.bench.run import main
from tests.fakes.llama import FakeLlamaServer


def test_passages_are_deterministic_and_sized() -> None:
    first, second = make_passages(3), make_passages(3)
    assert first == second and len(first) == 3
    assert all(550 <= len(p) <= 700 for p in first)


def test_every_scenario_writes_json_markdown_and_plots(tmp_path: Path) -> None:
    code = main(
        [
            "--requests",
            "2",
            "--seconds",
            "0.3",
            "--rounds",
            "1",
            "--passages",
            "3",
            "--stream-latency-ms",
            "30",
            "--stream-sizes",
            "6",
            "--workers",
            "1,2",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    assert set(report["overhead"]) == set(KINDS)
    for kind, sizes in report["overhead"].items():
        assert set(sizes) == {"10", "40", "100"}
        assert all(
            r["p50_ms"] > 0
            and r["cpu_us_per_pair"] >= 0
            and r["busy_cpu_us_per_pair"] >= 0
            and r["bare_grpc_cpu_us_per_pair"] >= 0
            for r in sizes.values()
        )
        for size, r in sizes.items():
            # The request's own backend calls, replayed straight to the fake: one per
            # pair for the per-pair kinds, fewer for the batching ones.
            calls = r["backend_calls"]
            assert calls == int(size) if kind in ("chat", "ollama") else 1 <= calls <= 2
            assert r["direct_p50_ms"] > 0 and r["bare_grpc_p50_ms"] > 0
            assert r["added_p50_ms"] == round(r["p50_ms"] - r["direct_p50_ms"], 2)
    assert set(report["throughput"]) == {"1", "2"}  # --workers
    for by_clients in report["throughput"].values():
        assert set(by_clients) == {"1", "4", "16", "64"}
        assert all(r["errors"] == 0 and r["requests_per_s"] > 0 for r in by_clients.values())
    assert set(report["telemetry"]) == {"chat", "rerank"}  # per pair, and batched
    for kind, telemetry in report["telemetry"].items():
        assert telemetry["backend"] == kind
        assert telemetry["requests"] == 20 and telemetry["off"]["cpu_ratio"] == 1.0
        assert all(
            telemetry[s]["cpu_ms_per_request"] > 0
            for s in (
                "off",
                "metrics",
                "metrics+traces",
                "metrics+traces+steps",
                "metrics+traces+calls",
            )
        )
    model = report["model"]
    assert model["through_over_direct"] > 0
    # The physical limit beside it: the stand-in's weights and the same 3 prompts' tokens
    # in eager PyTorch (the converter's environment, built by `make test-assets`).
    eager = model["eager"]
    assert (eager["pairs"], eager["rounds"], eager["dtype"]) == (3, 1, "float32"), eager
    assert eager["tokens"] > 3 * 100 and eager["pairs_per_s"] > 0
    assert eager["through_over_eager"] == pytest.approx(
        model["through_pairs_per_s"] / eager["pairs_per_s"], rel=0.05
    )
    streaming = report["streaming"]
    assert set(streaming) == {"fixed 30 ms x2, 12", "fixed 5 ms x4, 6", "llama-server x4, 6"}
    for label, blends in streaming.items():
        assert set(blends) == {"default", "position_aware", "linear", "rerank_only", "adaptive"}
        for r in blends.values():
            if "no_reranker_weight" in r["blended_by"]:
                # Answered at once, no pair sent: a millisecond or two either way, so
                # their ratio is noise; both must be immediate.
                assert r["first_result_ms"] < 100 and r["whole_answer_ms"] < 100
            elif label.startswith("llama-server"):
                # One round against a real model on a shared 2-core machine: one timing
                # of each, seconds long, which can differ by half (a stream once took
                # 3.5 s against 2.0 s for the whole answer under rerank_only, where both
                # wait for every pair; three rounds gave 0.94).
                assert r["first_over_whole"] > 0
            else:
                # One timing each: at a whole answer of 13 ms a first result 6 ms later
                # is the machine's noise (1.5 times), so a few ms of slack.
                assert r["first_over_whole"] > 0
                assert r["first_result_ms"] <= 1.5 * r["whole_answer_ms"] + 10
    # The stand-in's shipped profile gives the reranker no weight: nothing is scored.
    assert (
        streaming["llama-server x4, 6"]["default"]["blended_by"]
        == "profile smollm2-135m-standin (no_reranker_weight)"
    )
    assert streaming["fixed 30 ms x2, 12"]["default"]["blended_by"] == "adaptive"
    assert report["backends"]["completion_over_chat"] > 0
    assert report["plots"] == ["bench-latency.png", "bench-throughput.png"]
    for plot in report["plots"]:
        assert (tmp_path / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    markdown = (tmp_path / "bench.md").read_text()
    assert "#### Overhead" in markdown and "#### Telemetry, `rerank`" in markdown
    assert f"through rerank-server is {eager['through_over_eager']} of it" in markdown


@pytest.mark.parametrize("kind", ["embedding", "rerank"])
def test_model_and_streaming_against_any_backend(tmp_path: Path, kind: str) -> None:
    """`--backend-url` measures a running backend of any kind (here the bench's fake)
    directly and through rerank-server, instead of the cached llama-server."""
    with fake_backend(latency_ms=5) as url:
        code = main(
            [
                "--scenarios",
                "model,streaming,backends",
                "--rounds",
                "1",
                "--passages",
                "5",
                "--stream-latency-ms",
                "12",
                "--stream-sizes",
                "4",
                "--backend-url",
                url,
                "--backend",
                kind,
                "--slots",
                "2",
                "--out",
                str(tmp_path),
            ]
        )
    assert code == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    model = report["model"]
    assert (model["backend"], model["slots"], model["passages"]) == (kind, 2, 5)
    assert model["through_over_direct"] > 0 and model["direct_pairs_per_s"] > 0
    assert 0 < model["direct_p50_ms"] <= model["direct_p95_ms"]
    assert 0 < model["through_p50_ms"] <= model["through_p95_ms"]
    assert "external x2, 4" in report["streaming"]
    assert "backends" not in report  # chat against completion is for llama-server
    # No GGUF known for a backend bench did not start: no physical limit, and why.
    assert model["eager"] == {"skipped": "--eager-model names the GGUF that --backend-url serves"}
    markdown = (tmp_path / "bench.md").read_text()
    assert url in markdown and "Physical limit not measured: --eager-model" in markdown


def test_the_settings_grid_runs_llama_server_per_cell(tmp_path: Path) -> None:
    code = main(
        [
            "--scenarios",
            "settings",
            "--grid",
            "1:512",
            "--rounds",
            "1",
            "--passages",
            "3",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    cell = json.loads((tmp_path / "bench.json").read_text())["settings"]["-np 1 -ub 512"]
    assert cell["chat"]["pairs_per_s"] > 0 and cell["completion"]["pairs_per_s"] > 0
    # Pairs were scored (the stand-in's profile alone would send none: milliseconds).
    assert cell["chat"]["ms"] > 20 and cell["completion"]["ms"] > 20
    assert "`-np 1 -ub 512`" in (tmp_path / "bench.md").read_text()


def test_completion_options_call_llama_server_directly(tmp_path: Path) -> None:
    code = main(
        [
            "--scenarios",
            "completion-options",
            "--rounds",
            "1",
            "--passages",
            "2",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    options = json.loads((tmp_path / "bench.json").read_text())["completion_options"]
    assert set(options) == {
        "n_probs 20, cache_prompt on",
        "n_probs 5, cache_prompt on",
        "n_probs 1, cache_prompt on",
        "n_probs 20, cache_prompt off",
    }
    assert all(r["ms"] > 0 and 0.0 <= r["yes_or_no_in_top"] <= 1.0 for r in options.values())
    # What the completion backend asks for finds an answer token for every prompt.
    assert options["n_probs 20, cache_prompt on"]["yes_or_no_in_top"] == 1.0
    assert "#### `/completion` options" in (tmp_path / "bench.md").read_text()


async def test_the_fake_records_scoring_calls_and_replay_sends_them_at_the_concurrency() -> None:
    """The overhead scenario's direct time: the fake records a request's scoring calls
    (not its metadata calls), and `Replay` sends exactly those, `connections` at a time."""
    body = b'{"query": "q", "documents": ["a", "b"]}'
    with fake_backend(latency_ms=40) as url:
        async with httpx.AsyncClient() as http:
            await replay.start_recording(http, url)
            for _ in range(4):
                (await http.post(url + "/v1/rerank", content=body)).raise_for_status()
            (await http.post(url + "/tokenize", content=b'{"content": "yes"}')).raise_for_status()
            calls = await replay.recorded_calls(http, url)
            assert calls == [("/v1/rerank", body)] * 4
            assert await replay.recorded_calls(http, url) == []  # recording stopped
        async with replay.Replay(url, calls, connections=2) as backend:
            started = time.perf_counter()
            await backend.run()
            elapsed = time.perf_counter() - started
    # Four 40 ms calls, two at a time: two rounds (80 ms), neither all at once (40 ms)
    # nor one by one (160 ms).
    assert 0.08 <= elapsed < 0.16


def test_model_load_compares_pairs_per_second_under_one_limit(tmp_path: Path) -> None:
    """`--clients`: pairs/s with several clients at once, directly and through. Against a
    backend taking 20 ms a call with 2 slots, neither side can pass 2 / 20 ms = 100 pairs
    a second: the direct clients share one limit of the slot count, as rerank-server's
    requests share `--concurrency` (three direct clients with a limit each would reach
    three times that)."""
    with fake_backend(latency_ms=20) as url:
        code = main(
            [
                "--scenarios",
                "model",
                "--rounds",
                "1",
                "--passages",
                "6",
                "--backend-url",
                url,
                "--backend",
                "chat",
                "--slots",
                "2",
                "--clients",
                "1,3",
                "--seconds",
                "1.5",
                "--out",
                str(tmp_path),
            ]
        )
    assert code == 0
    load = json.loads((tmp_path / "bench.json").read_text())["model"]["load"]
    assert set(load) == {"1", "3"}
    for cell in load.values():
        assert 20 < cell["direct_pairs_per_s"] <= 110
        assert 20 < cell["through_pairs_per_s"] <= 110
        assert 0.4 < cell["through_over_direct"] < 2.5
        # Halves in the order direct, through, through, direct, so that a backend slowing
        # down over the run (llama-server's /v1/rerank with its prompt cache) weighs on
        # both sides alike.
        assert [h.split()[0] for h in cell["halves"]] == ["direct", "through", "through", "direct"]
        assert all(20 < float(h.split()[1]) <= 110 for h in cell["halves"])
    assert "| 3 |" in (tmp_path / "bench.md").read_text()


def test_pairs_not_scored_are_counted_not_timed_as_answers(tmp_path: Path) -> None:
    """A degraded answer through rerank-server is fast and in retrieval order: timed as if
    scored it would flatter rerank-server. Against a backend that fails every call on one
    of the six passages, both sides count that pair as lost in every request, the load's
    rates count only scored pairs, a failed direct call does not stop the run, and the
    report says the figures are not comparable."""
    fake = FakeLlamaServer(failing_markers=("Winter",)).start()  # in passage 4 alone
    try:
        code = main(
            [
                "--scenarios",
                "model",
                "--rounds",
                "2",
                "--passages",
                "6",
                "--backend-url",
                fake.url,
                "--backend",
                "chat",
                "--slots",
                "2",
                "--clients",
                "1",
                "--seconds",
                "1",
                "--out",
                str(tmp_path),
            ]
        )
    finally:
        fake.stop()
    assert code == 0
    model = json.loads((tmp_path / "bench.json").read_text())["model"]
    assert (model["direct_failed_pairs"], model["through_unscored_pairs"]) == (2, 2)
    load = model["load"]["1"]
    assert load["direct_failed_pairs"] >= 1 and load["through_unscored_pairs"] >= 1
    # Each request lost one pair, so it scored five: over a run of at least 1 s the rate
    # is at most five pairs a second per request made (six if lost pairs counted).
    for rate, lost in (
        (load["direct_pairs_per_s"], load["direct_failed_pairs"]),
        (load["through_pairs_per_s"], load["through_unscored_pairs"]),
    ):
        assert 0 < rate <= 5 * lost + 0.1
    assert "**Not comparable:**" in (tmp_path / "bench.md").read_text()
