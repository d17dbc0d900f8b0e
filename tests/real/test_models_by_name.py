"""Models by name, as an operator runs them: `rerank-server --managed --model
mini=hf:ORG/REPO/FILE.gguf --model chat=PATH` with `HF_ENDPOINT` at a loopback hub and an
empty cache. MiniLM is fetched (with progress on stderr) and scored by `embedding`, the
chat model by `chat`, each by its own llama-server; JSON and gRPC requests are routed by
`model`; an unknown name is answered with the served names; a second start with
`HF_HUB_OFFLINE=1` serves from the cache without a request to the hub."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from rerank_client import AsyncRerankClient, ModelNotFoundError

from rerank_server import settings
from rerank_server.managed import converted
from rerank_server.managed.child_process import free_port
from tests.fakes.hub import FakeHub
from tests.real.conftest import assets_or_fail
from tests.server_process import stop_process

REPO = "rerank-test/all-MiniLM-L6-v2-GGUF"
FILE = "all-MiniLM-L6-v2.f16.gguf"
QUERY = "what do cats eat?"
DOCS = [
    "The stock market fell.",
    "Kittens need milk.",
    "Cats are obligate carnivores that eat meat.",
]


@pytest.fixture(scope="module")
def hub() -> Iterator[FakeHub]:
    minilm = converted.embedding_model_path(settings.load([]).cache_dir)
    fake = FakeHub(repos={REPO: {FILE: minilm.read_bytes(), "README.md": b"MiniLM"}}).start()
    yield fake
    fake.stop()


def two_models(hub: FakeHub) -> list[str]:
    _, chat_model = assets_or_fail()
    return [
        *("--llama-ctx-per-slot", "1024", "--concurrency", "2"),
        *("--model", f"mini=hf:{REPO}/{FILE}", "--model", f"chat={chat_model}"),
    ]


@asynccontextmanager
async def serving(
    cache: Path, args: list[str], logs: Path, **env: str
) -> AsyncIterator[tuple[int, int, Path]]:
    """(gRPC port, HTTP port, output file: log lines and stderr) of `rerank-server
    --managed ARGS` with its assets in `cache`, once it answers `/health`."""
    binary, _ = assets_or_fail()
    port, http_port = free_port(), free_port()
    stderr = logs / f"output-{port}.txt"
    full = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("HF_", "RERANK_"))},
        "RERANK_CACHE_DIR": str(cache),
        "RERANK_LLAMA_SERVER": str(binary),
        "RERANK_LOG_FORMAT": "json",
        **env,
    }
    args = [
        *("--managed", "--port", str(port), "--http-port", str(http_port)),
        *("--metrics-port", "0", *args),
    ]
    with stderr.open("wb") as err:
        proc = subprocess.Popen(  # noqa: ASYNC220 (waited for below, off the loop)
            [sys.executable, "-m", "rerank_server", *args],
            env=full,
            stdout=err,
            stderr=subprocess.STDOUT,
        )
    try:
        await _healthy(http_port, proc, stderr)
        yield port, http_port, stderr
    finally:
        await stop_process(proc, 15)


async def _healthy(http_port: int, proc: subprocess.Popen[bytes], stderr: Path) -> None:
    deadline = time.monotonic() + 240
    async with httpx.AsyncClient(timeout=2) as http:
        while time.monotonic() < deadline:
            assert proc.poll() is None, _tail(stderr)
            try:
                if (await http.get(f"http://127.0.0.1:{http_port}/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)
    raise AssertionError(f"not serving: {_tail(stderr)}")


def events(output: str, name: str) -> list[dict[str, Any]]:
    """The JSON log lines of event `name` in a server's output."""
    lines = (json.loads(line) for line in output.splitlines() if line.startswith("{"))
    return [e for e in lines if e.get("event") == name]


def _tail(path: Path) -> str:
    return path.read_text()[-3000:]


async def rerank_json(http_port: int, **body: Any) -> httpx.Response:
    async with httpx.AsyncClient(timeout=60) as http:
        return await http.post(
            f"http://127.0.0.1:{http_port}/v2/rerank",
            json={"query": QUERY, "documents": DOCS, **body},
        )


async def test_two_models_fetched_served_and_routed_then_started_offline(
    tmp_path: Path, hub: FakeHub
) -> None:
    fetch = {"HF_ENDPOINT": hub.url}
    async with serving(tmp_path, two_models(hub), tmp_path, **fetch) as (port, http_port, stderr):
        said = stderr.read_text()
        assert f"downloading {REPO}/{FILE}" in said and "downloaded" in said, said[-2000:]
        planned = {e["served_as"]: e for e in events(said, "llama_server_memory")}
        assert planned["mini"]["kv_cache_bytes"] == 0  # an encoder keeps none
        assert planned["chat"]["kv_cache_bytes"] == 23_040 * 2 * 1024  # 2 slots of 1024
        (held,) = events(said, "managed_memory")
        assert held["llama_servers"] == 2
        assert held["estimate_bytes"] == sum(e["estimate_bytes"] for e in planned.values())
        assert held["estimate_bytes"] <= held["resident_bytes"] <= held["estimate_bytes"] + 256e6
        mini = (await rerank_json(http_port, model="mini")).json()
        assert mini["meta"]["model"] == "mini" and mini["meta"]["backend"] == "embedding"
        assert mini["results"][0]["index"] == 2  # the cats document
        chat = (await rerank_json(http_port, model="chat")).json()
        assert chat["meta"]["model"] == "chat" and chat["meta"]["backend"] == "chat"
        unknown = await rerank_json(http_port, model="rerank-v3.5")
        assert unknown.status_code == 404
        assert "'rerank-v3.5'" in unknown.json()["message"]
        assert "mini, chat" in unknown.json()["message"]
        async with httpx.AsyncClient() as http:
            listed = (await http.get(f"http://127.0.0.1:{http_port}/v1/models")).json()
        assert [(m["id"], m["backend"]) for m in listed["data"]] == [
            ("mini", "embedding"),
            ("chat", "chat"),
        ]
        async with AsyncRerankClient(f"127.0.0.1:{port}") as client:
            answer = await client.rerank(QUERY, DOCS, model="mini")
            assert answer.summary.model == "mini" and answer.results[0].index == 2
            assert (await client.rerank(QUERY, DOCS)).summary.model == "mini"  # the default
            with pytest.raises(ModelNotFoundError, match="served: mini, chat"):
                await client.rerank(QUERY, DOCS, model="nope")
    fetched = len(hub.requests("GET", REPO, FILE))
    assert fetched >= 1
    calls = len(hub.calls)
    offline = {**fetch, "HF_HUB_OFFLINE": "1"}
    async with serving(tmp_path, two_models(hub), tmp_path, **offline) as (_, http_port, _):
        again = (await rerank_json(http_port, model="mini")).json()
        assert again["results"][0]["index"] == 2
    assert len(hub.calls) == calls, "an offline start asked the hub"


README = Path(__file__).resolve().parents[2] / "README.md"


async def test_the_readmes_first_command_puts_the_cats_document_first(tmp_path: Path) -> None:
    """`make run` (managed mode, the default model) and the README's client command, as
    pasted: the cats document first, reranked by the model."""
    command = re.search(r"```bash\n(\.venv/bin/rerank-client .*?)```", README.read_text(), re.S)
    assert command is not None
    argv = shlex.split(command.group(1).replace("\\\n", " "))
    cache = settings.load([]).cache_dir
    async with serving(cache, [], tmp_path) as (port, _, _):
        client = Path(sys.executable).parent / "rerank-client"
        shown = await asyncio.to_thread(
            subprocess.run,
            [str(client), *argv[1:], "--target", f"127.0.0.1:{port}"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    lines = shown.stdout.splitlines()
    assert shown.returncode == 0, shown.stderr
    assert lines[1].split(maxsplit=5)[-1] == "Cats are obligate carnivores that eat meat.", lines
    assert lines[-1].startswith("reranked by embedding (all-MiniLM-L6-v2.f16.gguf)"), lines


async def test_a_cross_encoder_gguf_is_scored_by_rerank(tmp_path: Path) -> None:
    """The suite's MiniLM with a classification head (no pooling key, `cls.output`
    tensors) under managed mode: llama-server --rerank, every pair scored."""
    head = converted.rank_head_model_path(settings.load([]).cache_dir)
    async with serving(settings.load([]).cache_dir, ["--model", f"ce={head}"], tmp_path) as (
        _,
        http_port,
        stderr,
    ):
        answer = (await rerank_json(http_port, model="ce")).json()
        said = stderr.read_text()
    assert answer["meta"]["backend"] == "rerank" and answer["meta"]["scored"] == len(DOCS)
    assert "cross-encoder (bert, a classification head (cls.output.weight))" in said
