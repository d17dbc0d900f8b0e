"""Managed mode's llama-server keeps its memory while it scores: with llama-server's
defaults, its host-memory prompt cache took every new prompt (reranking sends nothing
but new prompts) and grew by about 1 MB a scored pair up to 8 GiB, far past the 4 GiB
the deployment gives it (rerank_server/managed/llama_server.py, `RAM_CACHE_OFF`)."""

from __future__ import annotations

import asyncio
import stat
from pathlib import Path

import httpx
import pytest

from rerank_server.managed import llama_server, memory
from rerank_server.managed.gguf_meta import read_header
from rerank_server.managed.llama_server import ManagedLlamaServer, knows_flag
from rerank_server.scoring.backends import prompt
from rerank_server.settings import DEFAULT_INSTRUCTION
from tests.real.conftest import assets_or_fail
from tests.waiting import eventually

SLOTS = 4


def _resident_mb(pid: int) -> float:
    resident = memory.resident_bytes(pid)
    assert resident is not None, f"no VmRSS for {pid}"
    return resident / (1 << 20)


async def _score(url: str, pairs: int, tag: str) -> None:
    """`pairs` chat calls as the `chat` backend makes them, `SLOTS` at a time, each
    query new (as a stream of rerank requests is)."""
    limit = asyncio.Semaphore(SLOTS)

    async def one(http: httpx.AsyncClient, i: int) -> None:
        message = prompt.user_message(
            DEFAULT_INSTRUCTION,
            f"{tag} query {i // 4}",
            f"passage {i} about the river and its bank",
        )
        body = {
            "messages": [
                {"role": "system", "content": prompt.SYSTEM_PROMPT},
                {"role": "user", "content": message},
            ],
            "max_tokens": 1,
            "temperature": 0.0,
            "logprobs": True,
            "top_logprobs": 20,
        }
        async with limit:
            answer = await http.post(url + "/v1/chat/completions", json=body)
        assert answer.status_code == 200, answer.text

    async with httpx.AsyncClient(timeout=60) as http:
        await asyncio.gather(*(one(http, i) for i in range(pairs)))


async def test_scoring_does_not_grow_llama_servers_memory(tmp_path: Path) -> None:
    binary, model = assets_or_fail()
    managed = ManagedLlamaServer(
        binary, model, slots=SLOTS, ctx_per_slot=1024, log_path=tmp_path / "llama-server.log"
    )
    await managed.start()
    try:
        assert managed.pid is not None
        assert " --cache-ram 0 " in f" {' '.join(managed.command())} "
        await _score(managed.url, 16, "warm-up")  # first allocations of every slot
        before = _resident_mb(managed.pid)
        await _score(managed.url, 120, "measured")
        grown = _resident_mb(managed.pid) - before
    finally:
        await managed.stop()
    # With llama-server's defaults: about 130 MB for these 120 pairs, and growing.
    assert grown < 30, f"llama-server grew by {grown:.0f} MB over 120 pairs"


async def _resident_when_ready(tmp_path: Path, slots: int, ctx_per_slot: int) -> int:
    binary, model = assets_or_fail()
    managed = ManagedLlamaServer(
        binary,
        model,
        slots=slots,
        ctx_per_slot=ctx_per_slot,
        log_path=tmp_path / f"llama-server-{slots}.log",
    )
    await managed.start()
    try:
        resident = memory.resident_bytes(managed.pid)
    finally:
        await managed.stop()
    assert resident is not None
    return resident


async def test_the_memory_said_before_start_is_what_llama_server_holds(tmp_path: Path) -> None:
    """The KV cache estimated from the GGUF's metadata is what a llama-server with more
    context takes (SmolLM2: 30 layers, 3 KV heads of 64: 23,040 bytes a token), and the
    whole estimate is what it holds once ready, short of its compute buffers."""
    _, model = assets_or_fail()
    header = read_header(model)
    small, large = (1, 512), (4, 4096)
    grown = await _resident_when_ready(tmp_path, *large) - await _resident_when_ready(
        tmp_path, *small
    )
    kv = [memory.kv_cache_bytes(header, s * c) for s, c in (small, large)]
    assert kv[0] == 23_040 * 512
    assert kv[1] - kv[0] == pytest.approx(grown, rel=0.1), f"grew by {grown / 1e6:.0f} MB"
    whole = memory.estimate(header, 4 * 4096, []).total_bytes
    resident = await _resident_when_ready(tmp_path, *large)
    assert whole is not None and whole <= resident <= whole + 128e6


async def _command_run(tmp_path: Path, extra_args: list[str]) -> list[str]:
    """The command line managed mode started a (real) llama-server with."""
    binary, model = assets_or_fail()
    managed = ManagedLlamaServer(
        binary,
        model,
        slots=1,
        ctx_per_slot=512,
        extra_args=extra_args,
        log_path=tmp_path / "llama-server.log",
    )
    await managed.start()
    try:
        return managed.command()
    finally:
        await managed.stop()


async def test_the_operators_own_cache_setting_is_kept(tmp_path: Path) -> None:
    command = await _command_run(tmp_path, ["--cache-ram", "64"])
    assert command.count("--cache-ram") == 1
    assert command[command.index("--cache-ram") + 1] == "64"


async def test_the_operators_variable_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """llama-server reads `LLAMA_ARG_CACHE_RAM` too, and an argument would override it."""
    monkeypatch.setenv("LLAMA_ARG_CACHE_RAM", "64")
    assert "--cache-ram" not in await _command_run(tmp_path, [])


async def test_a_help_that_never_ends_is_given_up_with_what_it_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wrapper whose `--help` hangs, with a child holding its output open: the flag is
    not passed, and neither the wrapper nor its child outlives the question."""
    monkeypatch.setattr(llama_server, "HELP_TIMEOUT_S", 0.5)
    child = tmp_path / "child.pid"
    wrapper = tmp_path / "llama-server"
    wrapper.write_text(f"#!/bin/sh\nsleep 600 &\necho $! > {child}\nsleep 600\n")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    assert not await asyncio.wait_for(knows_flag(wrapper, "--cache-ram"), 5)
    pid = int(child.read_text())
    assert await eventually(lambda: _dead(pid), 5)


def _dead(pid: int) -> bool:
    """Gone, or a zombie (killed, its new parent yet to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


async def test_a_build_without_the_flag_is_not_given_it(tmp_path: Path) -> None:
    """An older llama-server refuses flags it does not know, so the flag is only passed
    to a binary whose `--help` lists it."""
    binary, _ = assets_or_fail()
    assert await knows_flag(binary, "--cache-ram")
    assert await knows_flag(binary, "-cram")
    assert not await knows_flag(binary, "--cache-ra")
    old = tmp_path / "llama-server"
    old.write_text(
        "#!/bin/sh\necho '-np, --parallel N    number of slots'\n"
        "echo '--cache-reuse N    min chunk size (see --cache-ram elsewhere)'\n"
    )
    old.chmod(old.stat().st_mode | stat.S_IXUSR)
    assert await knows_flag(old, "-np")
    assert not await knows_flag(old, "--cache-ram")
    assert not await knows_flag(tmp_path / "missing", "--cache-ram")
