"""The Qwen3-Reranker-0.6B speed twin (`managed/speed_twin.py`) is what `bench` measures
the real size with: llama-server serves it, and rerank-server scores every pair of it by
`completion` and `chat`, as it would a trained reranker's, rather than degrading.

Its rank heads check the tied/untied rule (`scoring_path._causal_rank_head`) on files in
the layout llama.cpp's converter writes (no `output.weight`; `cls.output` holds the
"yes" and "no" rows): tied, the rows are the token embeddings', and `completion` scores
what `llama-server --rerank` scores; untied, only `--rerank` reads the head."""

from __future__ import annotations

import math
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rerank_server import settings
from rerank_server.domain import BackendKind
from rerank_server.managed import assets, gguf_meta, scoring_path
from rerank_server.scoring.backends import prompt
from rerank_server.scoring.backends.completion import CompletionScorer
from rerank_server.scoring.base import ScoreRequest
from rerank_server.scoring.transport.pool import BackendPool
from tests.conftest import StartServer, client_of
from tests.real.conftest import RealLlama, _serve, assets_or_fail

DOCS = [
    "Rivers turn turbines in a dam.",
    "A cat sat on the mat.",
    "Tides can drive generators.",
    "The stock market fell.",
]
QUERY = "river energy"
# The instruction the converter writes into a Qwen3-Reranker's rerank template: what
# `--rerank` always asks, and so what a request must ask `completion` to compare them.
RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
# Two slots of 256 tokens; a pair's prompt here is about 95.
TWIN_ARGS = ["-np", "2", "-c", "512"]
# The two paths run the same weights but not the same batches (`completion` reuses a
# slot's cached prefix, `--rerank` evaluates each pair whole), and the order of the sums
# moves the twin's P(yes) by up to 0.006 (two `completion` runs of one request differ by
# as much). The untied head's scores are 0.06 from `completion`'s.
SAME_SCORE = 0.02
# One pair alone, evaluated whole in one batch on both paths: the same sums but the
# last matrix product's (1e-7 apart on the development machine). Two pairs' scores
# differ by 6e-4, so a prompt a token apart would show.
SAME_SUMS = 1e-4


def _write_twins(folder: Path, kind: str, *heads: str) -> dict[str, Path]:
    """The twin with each of `heads`, written at once by the converter's environment."""
    _, stand_in = assets_or_fail()
    python = settings.load([]).cache_dir / "convert-venv" / "bin" / "python"
    assert python.exists(), "no converter environment: run `make test-assets`"
    script = Path(assets.__file__).with_name("speed_twin.py")
    outs = {head: folder / f"twin-{head}.{kind}.gguf" for head in heads}
    writers = {
        head: subprocess.Popen(
            [str(python), str(script), str(stand_in), str(out), kind, head],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for head, out in outs.items()
    }
    for head, writer in writers.items():
        _, err = writer.communicate(timeout=600)
        assert writer.returncode == 0, f"speed_twin.py {head}: {err.decode()[-2000:]}"
    return outs


@pytest.fixture(scope="module")
def twin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealLlama]:
    binary, _ = assets_or_fail()
    out = _write_twins(tmp_path_factory.mktemp("twin"), "q8_0", "lm")["lm"]
    yield from _serve(binary, out, tmp_path_factory, ["-np", "2", "-c", "4096"])
    out.unlink()  # half a gigabyte


@pytest.mark.parametrize("backend", [BackendKind.COMPLETION, BackendKind.CHAT])
async def test_every_pair_of_the_twin_is_scored(
    twin: RealLlama, start_server: StartServer, backend: BackendKind
) -> None:
    server = await start_server(
        backend_url=twin.url,
        backend=backend,
        concurrency=2,
        assistant_prefill=False,
        timeout_ms=120_000,
    )
    async with client_of(server) as client:
        answer = await client.rerank("river energy", DOCS, timeout=120)
    assert answer.reranked, answer.summary
    assert answer.summary.scored == len(DOCS) and answer.summary.failed == 0


@pytest.fixture(scope="module")
def rank_twins(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """`rank-tied` and `rank` (untied), q8_0, in one folder for the module."""
    started = time.monotonic()
    twins = _write_twins(tmp_path_factory.mktemp("rank-twins"), "q8_0", "rank-tied", "rank")
    print(f"\nrank twins written in {time.monotonic() - started:.1f} s")
    yield twins
    for path in twins.values():
        path.unlink()  # half a gigabyte each


def _served(
    twins: dict[str, Path], head: str, args: list[str], factory: pytest.TempPathFactory
) -> Iterator[RealLlama]:
    binary, _ = assets_or_fail()
    yield from _serve(binary, twins[head], factory, [*args, *TWIN_ARGS])


@pytest.fixture(scope="module")
def tied_rerank(
    rank_twins: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RealLlama]:
    yield from _served(rank_twins, "rank-tied", ["--rerank"], tmp_path_factory)


@pytest.fixture(scope="module")
def tied_causal(
    rank_twins: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RealLlama]:
    """The tied twin as managed mode serves it for `completion`: no `--rerank`."""
    yield from _served(rank_twins, "rank-tied", [], tmp_path_factory)


@pytest.fixture(scope="module")
def untied_rerank(
    rank_twins: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RealLlama]:
    yield from _served(rank_twins, "rank", ["--rerank"], tmp_path_factory)


@pytest.fixture(scope="module")
def untied_causal(
    rank_twins: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RealLlama]:
    """The untied twin served for `completion`, which managed mode never chooses for it."""
    yield from _served(rank_twins, "rank", [], tmp_path_factory)


def _tensor_bytes(path: Path) -> dict[str, bytes]:
    """Each tensor's stored bytes (its data up to the next tensor's), by name."""
    header = gguf_meta.read_header(path)
    spans = sorted((t.offset, name) for name, t in header.tensors.items())
    ends = [offset for offset, _ in spans[1:]] + [path.stat().st_size]
    with path.open("rb") as f:
        out = {}
        for (offset, name), end in zip(spans, ends, strict=True):
            f.seek(offset)
            out[name] = f.read(end - offset)
        return out


def test_the_rule_reads_tied_rows_as_completion_and_untied_ones_as_rerank(
    rank_twins: dict[str, Path],
) -> None:
    """The tied twin's `cls.output` is token_embd's "yes" and "no" rows, byte for byte in
    q8_0, as llama.cpp's converter writes a tied Qwen3-Reranker: `completion`. The untied
    twin differs from it in `cls.output` alone: `rerank`."""
    tied, untied = rank_twins["rank-tied"], rank_twins["rank"]
    header = gguf_meta.read_header(tied)
    yes, no = header.answer_ids["yes"], header.answer_ids["no"]
    assert "output.weight" not in header.tensors
    tied_bytes, untied_bytes = _tensor_bytes(tied), _tensor_bytes(untied)
    row = len(tied_bytes["cls.output.weight"]) // 2
    embd = tied_bytes["token_embd.weight"]
    assert (
        tied_bytes["cls.output.weight"]
        == embd[yes * row : (yes + 1) * row] + embd[no * row : (no + 1) * row]
    )
    assert [n for n in tied_bytes if tied_bytes[n] != untied_bytes[n]] == ["cls.output.weight"]

    for path, backend in ((tied, BackendKind.COMPLETION), (untied, BackendKind.RERANK)):
        chosen = scoring_path.read_path(path)
        assert chosen is not None and chosen.backend is backend, chosen


async def test_the_completion_prompt_is_the_rerank_template_byte_for_byte(
    rank_twins: dict[str, Path], tied_causal: RealLlama
) -> None:
    """With the template's own instruction, `completion` (prefill on, the default)
    sends what `--rerank` renders from the GGUF's rerank template, byte for byte."""
    template = gguf_meta.read(rank_twins["rank-tied"])["tokenizer.chat_template.rerank"]
    assert f"<Instruct>: {RERANK_INSTRUCTION}\n" in template
    pool = BackendPool([tied_causal.url], concurrency=2, timeout_s=60, kind="completion")
    try:
        scorer = CompletionScorer(pool, assistant_prefill=True)
        prefix, suffix = await scorer.template(ScoreRequest(QUERY, RERANK_INSTRUCTION, DOCS))
    finally:
        await pool.aclose()
    for doc in DOCS:
        rendered = template.replace("{query}", QUERY).replace("{document}", doc)
        assert prefix + prompt.neutralize(doc) + suffix == rendered


async def _one_pair_each(
    tied_rerank: RealLlama, tied_causal: RealLlama
) -> list[tuple[float, int, float, int]]:
    """(P(yes) by `--rerank`, its tokens, P(yes) by `/completion`, its tokens) for each
    pair sent alone, the completion prompt whole and uncached, as `--rerank` sends it."""
    template = gguf_meta.read(tied_causal.model)["tokenizer.chat_template.rerank"]
    out = []
    async with httpx.AsyncClient(timeout=120) as http:
        for doc in DOCS[:2]:
            ranked = (
                await http.post(
                    tied_rerank.url + "/v1/rerank", json={"query": QUERY, "documents": [doc]}
                )
            ).json()
            body = {
                "prompt": template.replace("{query}", QUERY).replace("{document}", doc),
                "n_probs": 20,
                "n_predict": 1,
                "temperature": 0.0,
                "cache_prompt": False,
            }
            done = (await http.post(tied_causal.url + "/completion", json=body)).json()
            top = {
                e["token"]: e["logprob"]
                for e in done["completion_probabilities"][0]["top_logprobs"]
            }
            out.append(
                (
                    ranked["results"][0]["relevance_score"],
                    ranked["usage"]["prompt_tokens"],
                    1 / (1 + math.exp(top["no"] - top["yes"])),
                    done["tokens_evaluated"],
                )
            )
    return out


async def test_a_pair_alone_scores_the_same_on_both_paths_of_the_tied_twin(
    tied_rerank: RealLlama, tied_causal: RealLlama
) -> None:
    """`--rerank` returns the softmax of the two `cls.output` logits at the last token,
    P(yes); the LM head's "yes" and "no" logits at the same place, softmaxed, are the
    same numbers when the batches are alike: the same tokens, the same rows."""
    for rerank, rerank_tokens, completion, completion_tokens in await _one_pair_each(
        tied_rerank, tied_causal
    ):
        print(f"pair alone: --rerank {rerank:.7f}, completion logprobs {completion:.7f}")
        assert rerank_tokens == completion_tokens
        assert abs(rerank - completion) < SAME_SUMS


async def _scores(start_server: StartServer, backend: BackendKind, url: str) -> list[float]:
    """Each of DOCS' reranker score through rerank-server's `backend`, in DOCS' order."""
    server = await start_server(
        backend_url=url,
        backend=backend,
        concurrency=2,
        assistant_prefill=True,
        timeout_ms=120_000,
        backend_timeout_ms=120_000,
    )
    async with client_of(server) as client:
        answer = await client.rerank(QUERY, DOCS, instruction=RERANK_INSTRUCTION, timeout=120)
    assert answer.summary.scored == len(DOCS) and answer.summary.failed == 0, answer.summary
    scores = {r.index: r.reranker_score for r in answer.results}
    return [s for _, s in sorted(scores.items()) if s is not None]


async def test_the_tied_twin_scores_the_same_on_every_path_managed_mode_may_choose(
    start_server: StartServer, tied_rerank: RealLlama, tied_causal: RealLlama
) -> None:
    """Managed mode scores the tied twin by `completion`, or by `rerank` when told: the
    two give each pair the same P(yes), within the batches' rounding."""
    rerank = await _scores(start_server, BackendKind.RERANK, tied_rerank.url)
    completion = await _scores(start_server, BackendKind.COMPLETION, tied_causal.url)
    print(f"tied: rerank {_fmt(rerank)}; completion {_fmt(completion)}")
    assert len(rerank) == len(completion) == len(DOCS)
    assert max(abs(a - b) for a, b in zip(rerank, completion, strict=True)) < SAME_SCORE


async def test_the_untied_twin_is_scored_right_only_by_rerank(
    rank_twins: dict[str, Path],
    start_server: StartServer,
    untied_rerank: RealLlama,
    untied_causal: RealLlama,
) -> None:
    """Managed mode scores the untied twin by `rerank` only: `completion` there reads the
    embeddings' rows, not the head's, and misses `--rerank`'s scores by more than the
    tied twin's paths differ."""
    chosen = scoring_path.read_path(rank_twins["rank"])
    assert chosen is not None and chosen.backend is BackendKind.RERANK
    assert "--rerank" in chosen.llama_args
    rerank = await _scores(start_server, BackendKind.RERANK, untied_rerank.url)
    completion = await _scores(start_server, BackendKind.COMPLETION, untied_causal.url)
    print(f"untied: rerank {_fmt(rerank)}; completion {_fmt(completion)}")
    assert len(rerank) == len(completion) == len(DOCS)
    assert min(abs(a - b) for a, b in zip(rerank, completion, strict=True)) > SAME_SCORE


def _fmt(scores: list[float]) -> str:
    return " ".join(f"{s:.4f}" for s in scores)
