"""Models fetched from the Hugging Face hub by name (`hf:ORG/REPO[/FILE.gguf][@REVISION]`),
through huggingface_hub against a fake hub on loopback.

Every test sets HF_ENDPOINT (and HF_TOKEN, HF_HUB_OFFLINE, HF_HUB_CACHE) after
huggingface_hub was imported: that they take effect shows `fetch` reads them at each call.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import random
import re
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import huggingface_hub
import huggingface_hub.file_download
import pytest
import structlog

from rerank_server.errors import ConfigError
from rerank_server.managed.child_process import free_port
from rerank_server.managed.downloads import AssetError
from rerank_server.managed.hub import HubSource, fetch
from tests.fakes.hub import FakeHub

MIB = 1 << 20
# What huggingface_hub receives before it writes, in the tests that set it (10 MiB else).
CHUNK = 64 << 10


def blob(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    """A fake hub as HF_ENDPOINT, with none of the user's HF_* settings."""
    fake = FakeHub().start()
    for name in ("HF_TOKEN", "HF_HUB_OFFLINE", "HF_HUB_CACHE", "HF_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", fake.url)
    yield fake
    fake.stop()


def get(source: str, cache: Path) -> Path:
    return fetch(HubSource.parse(source), cache, progress=False)


def blobs(cache: Path, repo: str = "org/model") -> list[Path]:
    """Every file in the repository's `blobs/`: the blobs, and any partial or temporary file."""
    folder = cache / "hub" / f"models--{repo.replace('/', '--')}" / "blobs"
    return sorted(folder.iterdir()) if folder.is_dir() else []


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """huggingface_hub writes what it receives in chunks of 10 MiB: smaller ones let a
    download of 1 MiB stop part way with something written."""
    monkeypatch.setattr(huggingface_hub.constants, "DOWNLOAD_CHUNK_SIZE", CHUNK)


class CtrlCOn:
    """A stderr on which Ctrl-C is pressed when a progress line shows `text`: the
    KeyboardInterrupt comes from inside the download, as a real one does."""

    def __init__(self, text: str) -> None:
        self.text = text

    def write(self, text: str) -> int:
        if self.text in text:
            raise KeyboardInterrupt
        return len(text)

    def flush(self) -> None:
        pass


def interrupted(source: str, cache: Path) -> Path:
    """Fetch `source` into `cache` until Ctrl-C is pressed at 30%; the partial file left."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "stderr", CtrlCOn("30%"))
        with pytest.raises(KeyboardInterrupt):
            get(source, cache)
    (partial,) = blobs(cache)
    return partial


@pytest.mark.parametrize(
    ("source", "parsed"),
    [
        ("hf:org/model", HubSource("org/model", None)),
        ("hf:org/model@v2", HubSource("org/model", None, "v2")),
        ("hf:org/model/m-Q8_0.gguf", HubSource("org/model", "m-Q8_0.gguf")),
        ("hf:org/model/sub/m.GGUF@refs/pr/3", HubSource("org/model", "sub/m.GGUF", "refs/pr/3")),
    ],
)
def test_a_source_parses_and_prints_back(source: str, parsed: HubSource) -> None:
    assert HubSource.parse(source) == parsed
    assert str(parsed) == source


@pytest.mark.parametrize(
    "source",
    [
        "org/model/m.gguf",
        "hf:org",
        "hf:org/",
        "hf:org/model/",
        "hf:org//m.gguf",
        "hf:org/model/../m.gguf",
        "hf:org/mo del/m.gguf",
        "hf:org/model/m.safetensors",
        "hf:org/model/m.gguf@",
        "hf:org/model/m-Q8_0-00001-of-00003.gguf",
        "hf:org/model/m.gguf@../../x",
        "hf:org/model/m.gguf@/etc",
        "hf:org/model@refs//pr",
    ],
)
def test_a_malformed_source_is_a_config_error_naming_it(source: str) -> None:
    with pytest.raises(ConfigError, match="hf:ORG/REPO") as caught:
        HubSource.parse(source)
    assert repr(source) in str(caught.value)


def test_a_named_file_is_downloaded_into_the_hub_cache_with_progress_lines(
    hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = blob(300_000)
    hub.repos["org/model"] = {"sub/m-Q4_K_M.gguf": data, "README.md": b"# model"}

    with structlog.testing.capture_logs() as logged:
        path = get("hf:org/model/sub/m-Q4_K_M.gguf", tmp_path)

    events = [e for e in logged if e["event"] == "model_download"]
    assert [e["phase"] for e in events] == ["start", "done"]
    assert events[0]["endpoint"] == hub.url and events[0]["done_bytes"] == 0
    assert all(
        e["file"] == "org/model/sub/m-Q4_K_M.gguf" and e["total_bytes"] == len(data) for e in events
    )
    assert events[1]["done_bytes"] == len(data) and events[1]["percent"] == 100.0
    assert events[1]["seconds"] >= 0

    assert path.read_bytes() == data
    snapshots = tmp_path / "hub" / "models--org--model" / "snapshots"
    assert path == snapshots / FakeHub.commit(hub.repos["org/model"]) / "sub" / "m-Q4_K_M.gguf"
    assert len(hub.requests("GET", "org/model", "sub/m-Q4_K_M.gguf")) == 1
    err = capsys.readouterr().err
    assert f"[prepare] downloading org/model/sub/m-Q4_K_M.gguf (0.3 MB) from {hub.url}" in err
    assert "[prepare] downloaded org/model/sub/m-Q4_K_M.gguf: 0.3 MB in " in err


def test_a_progress_bar_when_asked_for(
    hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hub.repos["org/model"] = {"m.gguf": blob(300_000)}
    with structlog.testing.capture_logs() as logged:
        fetch(HubSource.parse("hf:org/model/m.gguf"), tmp_path, progress=True)
    assert logged == []  # log lines would break into the bar
    err = capsys.readouterr().err
    assert "org/model/m.gguf: 100%|" in err
    assert "[prepare] downloaded org/model/m.gguf: 0.3 MB in " in err


def test_a_second_fetch_downloads_nothing_and_hashes_nothing(
    hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hub.repos["org/model"] = {"m.gguf": blob(200_000)}
    first = get("hf:org/model/m.gguf", tmp_path)
    capsys.readouterr()

    assert get("hf:org/model/m.gguf", tmp_path) == first

    assert len(hub.requests("GET", "org/model", "m.gguf")) == 1
    assert len(hub.requests("HEAD", "org/model", "m.gguf")) == 2  # is it still current?
    assert capsys.readouterr().err == ""


def test_a_repository_alone_takes_its_q8_0_and_says_so(
    hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hub.repos["org/model"] = {
        "m-Q4_K_M.gguf": blob(1000, 1),
        "m-Q8_0.gguf": blob(1000, 2),
        "m-F16.gguf": blob(1000, 3),
        "mmproj-m-Q8_0.gguf": blob(1000, 4),  # a vision projector, not a model
        "README.md": b"# model",
    }

    path = get("hf:org/model", tmp_path)

    assert path.name == "m-Q8_0.gguf"
    assert path.read_bytes() == blob(1000, 2)
    assert "[prepare] hf:org/model: taking m-Q8_0.gguf, the Q8_0 one of its 3 GGUF files" in (
        capsys.readouterr().err
    )


def test_a_repository_with_one_gguf_takes_it(hub: FakeHub, tmp_path: Path) -> None:
    hub.repos["org/model"] = {"only-Q4_0.gguf": blob(1000), "config.json": b"{}"}
    assert get("hf:org/model", tmp_path).name == "only-Q4_0.gguf"


def test_a_repository_without_one_q8_0_asks_for_a_file(hub: FakeHub, tmp_path: Path) -> None:
    hub.repos["org/model"] = {"m-Q4_K_M.gguf": blob(1000, 1), "m-F16.gguf": blob(1000, 2)}
    with pytest.raises(AssetError) as caught:
        get("hf:org/model", tmp_path)
    assert str(caught.value) == (
        f"hf:org/model: org/model at main on {hub.url} has 2 GGUF files and none of them "
        "Q8_0; name one as hf:org/model/FILE.gguf: m-F16.gguf, m-Q4_K_M.gguf"
    )


def test_a_repository_of_split_ggufs_is_refused(hub: FakeHub, tmp_path: Path) -> None:
    hub.repos["org/model"] = {f"m-Q8_0-0000{i}-of-00002.gguf": blob(1000, i) for i in (1, 2)}
    with pytest.raises(AssetError, match=r"only split GGUF files .* not supported"):
        get("hf:org/model", tmp_path)


def test_an_interrupted_download_resumes_with_a_range_request(
    hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """huggingface_hub writes what it received in chunks of 10 MiB and asks for the rest
    from the end of the last whole chunk, so the cut comes after the first one."""
    data = blob(12 * MIB)
    hub.repos["org/model"] = {"m.gguf": data}
    hub.cuts = [11 * MIB]

    with structlog.testing.capture_logs() as logged:
        path = get("hf:org/model/m.gguf", tmp_path)
    progress = [e for e in logged if e["event"] == "model_download" and e["phase"] == "progress"]
    assert [e["percent"] for e in progress] == [83.3]  # at the first chunk; the second ends it
    assert progress[0]["done_bytes"] == 10 * MIB and progress[0]["total_bytes"] == 12 * MIB

    assert path.read_bytes() == data
    first, second = hub.requests("GET", "org/model", "m.gguf")
    assert "range" not in first.headers
    assert second.headers["range"] == f"bytes={10 * MIB}-"
    assert [b.name for b in blobs(tmp_path)] == [path.resolve().name]  # no partial file left
    assert "downloading org/model/m.gguf: 80% (10.5 MB of 12.6 MB)" in capsys.readouterr().err


@pytest.mark.usefixtures("small_chunks")
def test_a_download_ended_by_ctrl_c_is_resumed_by_the_next_start(
    hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = blob(MIB)
    hub.repos["org/model"] = {"m.gguf": data}

    partial = interrupted("hf:org/model/m.gguf", tmp_path)

    assert partial.name == f"{sha256(data)}.rerank-partial"
    kept = partial.stat().st_size
    assert 0 < kept < len(data)
    with structlog.testing.capture_logs() as logged:
        path = get("hf:org/model/m.gguf", tmp_path)
    phases = [(e["phase"], e["done_bytes"]) for e in logged if e["event"] == "model_download"]
    assert phases[0] == ("resume", kept) and phases[-1] == ("done", len(data))
    assert path.read_bytes() == data
    first, second = hub.requests("GET", "org/model", "m.gguf")
    assert "range" not in first.headers
    assert second.headers["range"] == f"bytes={kept}-"
    assert blobs(tmp_path) == [path.resolve()]  # the partial became the blob
    err = capsys.readouterr().err
    assert f"[prepare] resuming org/model/m.gguf at {kept / 1e6:.1f} MB of 1.0 MB from " in err
    assert "[prepare] checking the sha256 of org/model/m.gguf (1.0 MB)" in err


@pytest.mark.usefixtures("small_chunks")
def test_a_download_given_up_on_a_dropping_connection_is_resumed_by_the_next_start(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connection drops after three chunks, then at each retry before a whole chunk
    comes, until the library gives up; the next start asks for the rest."""
    monkeypatch.setattr(time, "sleep", lambda _s: None)  # the library's pause between tries
    data = blob(MIB)
    hub.repos["org/model"] = {"m.gguf": data}
    hub.cuts = [3 * CHUNK + 1000, *[1000] * 20]

    with pytest.raises(AssetError, match=r"cannot fetch .* \(RemoteProtocolError: "):
        get("hf:org/model/m.gguf", tmp_path)

    hub.cuts.clear()
    (partial,) = blobs(tmp_path)
    assert partial.stat().st_size == 3 * CHUNK
    path = get("hf:org/model/m.gguf", tmp_path)
    assert path.read_bytes() == data
    assert hub.requests("GET", "org/model", "m.gguf")[-1].headers["range"] == f"bytes={3 * CHUNK}-"
    assert blobs(tmp_path) == [path.resolve()]


@pytest.mark.usefixtures("small_chunks")
def test_a_partial_the_hub_answers_whole_is_downloaded_anew(hub: FakeHub, tmp_path: Path) -> None:
    """A server that ignores `Range` sends the whole file with 200: it replaces the
    partial instead of being appended to it."""
    data = blob(MIB)
    hub.repos["org/model"] = {"m.gguf": data}
    interrupted("hf:org/model/m.gguf", tmp_path)
    hub.ranges = False

    path = get("hf:org/model/m.gguf", tmp_path)

    assert path.read_bytes() == data
    assert "range" in hub.requests("GET", "org/model", "m.gguf")[-1].headers
    assert blobs(tmp_path) == [path.resolve()]


def test_a_whole_partial_is_checked_and_placed_without_a_download(
    hub: FakeHub, tmp_path: Path
) -> None:
    """The process ended between the last byte and the move into place."""
    data = blob(300_000)
    hub.repos["org/model"] = {"m.gguf": data}
    folder = tmp_path / "hub" / "models--org--model" / "blobs"
    folder.mkdir(parents=True)
    (folder / f"{sha256(data)}.rerank-partial").write_bytes(data)

    assert get("hf:org/model/m.gguf", tmp_path).read_bytes() == data
    assert hub.requests("GET", "org/model", "m.gguf") == []


@pytest.mark.usefixtures("small_chunks")
def test_a_resumed_download_is_in_the_cache_as_the_library_lays_it_out(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Offline, our fetch and the library's own find it: a relative link in the commit's
    snapshot, and `refs/main` naming the commit."""
    data = blob(MIB)
    hub.repos["org/model"] = {"m.gguf": data}
    commit = FakeHub.commit(hub.repos["org/model"])
    interrupted("hf:org/model/m.gguf", tmp_path)
    online = get("hf:org/model/m.gguf", tmp_path)
    asked = len(hub.calls)

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    storage = tmp_path / "hub" / "models--org--model"
    assert online == storage / "snapshots" / commit / "m.gguf"
    assert os.readlink(online) == f"../../blobs/{sha256(data)}"
    assert (storage / "refs" / "main").read_text() == commit
    assert get("hf:org/model/m.gguf", tmp_path) == online
    assert get("hf:org/model", tmp_path) == online
    library = huggingface_hub.hf_hub_download(
        "org/model", "m.gguf", cache_dir=tmp_path / "hub", local_files_only=True
    )
    assert library == str(online)
    assert len(hub.calls) == asked


def test_the_librarys_leftover_temporary_files_of_the_blob_are_removed(
    hub: FakeHub, tmp_path: Path
) -> None:
    """hf_hub_download's temporary file of a process killed mid-download is never reused;
    another blob's is left alone."""
    data = blob(300_000)
    hub.repos["org/model"] = {"m.gguf": data}
    folder = tmp_path / "hub" / "models--org--model" / "blobs"
    folder.mkdir(parents=True)
    (folder / f"{sha256(data)}.0a1b2c3d.incomplete").write_bytes(data[:1000])
    other = folder / f"{sha256(b'other')}.4e5f6a7b.incomplete"
    other.write_bytes(b"other")

    path = get("hf:org/model/m.gguf", tmp_path)

    assert blobs(tmp_path) == sorted([path.resolve(), other])


def test_a_download_another_process_holds_is_waited_for(
    hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two replicas sharing a cache: the second waits on the blob's lock, the one
    hf_hub_download takes (`.locks/models--ORG--REPO/<sha256>.lock`), here held by flock."""
    data = blob(300_000)
    hub.repos["org/model"] = {"m.gguf": data}
    lock = tmp_path / "hub" / ".locks" / "models--org--model" / f"{sha256(data)}.lock"
    lock.parent.mkdir(parents=True)
    fetched: dict[str, Path] = {}
    fetch_in_thread = threading.Thread(
        target=lambda: fetched.update(path=get("hf:org/model/m.gguf", tmp_path))
    )

    with lock.open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        fetch_in_thread.start()
        said, deadline = "", time.monotonic() + 10
        while "waiting" not in said and time.monotonic() < deadline:
            time.sleep(0.01)
            said += capsys.readouterr().err
        assert hub.requests("GET", "org/model", "m.gguf") == []

    fetch_in_thread.join(10)
    assert "[prepare] org/model/m.gguf: waiting for another process that is downloading it" in (
        said
    )
    assert fetched["path"].read_bytes() == data
    assert len(hub.requests("GET", "org/model", "m.gguf")) == 1


def test_a_download_that_fails_the_checksum_is_deleted_and_fetched_anew(
    hub: FakeHub, tmp_path: Path
) -> None:
    data = blob(300_000)
    hub.repos["org/model"] = {"m.gguf": data}
    hub.corrupt = True

    with pytest.raises(AssetError, match=r"hf:org/model/m.gguf: m.gguf does not match the sha256"):
        get("hf:org/model/m.gguf", tmp_path)

    assert blobs(tmp_path) == []  # neither the partial nor a blob
    snapshots = tmp_path / "hub" / "models--org--model" / "snapshots"
    assert [p for p in snapshots.rglob("*") if not p.is_dir()] == []
    hub.corrupt = False
    assert get("hf:org/model/m.gguf", tmp_path).read_bytes() == data
    assert len(hub.requests("GET", "org/model", "m.gguf")) == 2


@pytest.mark.usefixtures("small_chunks")
def test_a_resumed_download_that_fails_the_checksum_leaves_nothing(
    hub: FakeHub, tmp_path: Path
) -> None:
    hub.repos["org/model"] = {"m.gguf": blob(MIB)}
    interrupted("hf:org/model/m.gguf", tmp_path)
    hub.corrupt = True

    with pytest.raises(AssetError, match="does not match the sha256"):
        get("hf:org/model/m.gguf", tmp_path)

    assert blobs(tmp_path) == []
    assert not (tmp_path / "hub" / "models--org--model" / "snapshots").exists()


def test_a_cached_file_changed_after_its_check_is_checked_again(
    hub: FakeHub, tmp_path: Path
) -> None:
    hub.repos["org/model"] = {"m.gguf": blob(300_000)}
    path = get("hf:org/model/m.gguf", tmp_path)
    path.resolve().write_bytes(blob(300_000, seed=9))

    with pytest.raises(AssetError, match="does not match the sha256"):
        get("hf:org/model/m.gguf", tmp_path)

    assert not path.exists()
    assert blobs(tmp_path) == []


@pytest.mark.parametrize("source", ["hf:org/nope/m.gguf", "hf:org/nope"])
def test_a_missing_repository_is_named(hub: FakeHub, tmp_path: Path, source: str) -> None:
    with pytest.raises(AssetError) as caught:
        get(source, tmp_path)
    assert str(caught.value).startswith(f"{source}: no repository org/nope on {hub.url} (")
    assert "HF_TOKEN" in str(caught.value)


def test_a_missing_file_is_named_with_the_repositorys_ggufs(hub: FakeHub, tmp_path: Path) -> None:
    hub.repos["org/model"] = {"a-Q4_0.gguf": b"a", "b-Q8_0.gguf": b"b", "README.md": b"#"}
    with pytest.raises(AssetError) as caught:
        get("hf:org/model/c.gguf", tmp_path)
    assert str(caught.value) == (
        f"hf:org/model/c.gguf: org/model has no c.gguf at main on {hub.url}; "
        "its GGUF files: a-Q4_0.gguf, b-Q8_0.gguf"
    )


@pytest.mark.parametrize("source", ["hf:org/model/a.gguf@v9", "hf:org/model@v9"])
def test_a_missing_revision_is_named(hub: FakeHub, tmp_path: Path, source: str) -> None:
    hub.repos["org/model"] = {"a.gguf": b"a"}
    with pytest.raises(AssetError, match=re.escape(f"org/model has no revision 'v9' on {hub.url}")):
        get(source, tmp_path)


def test_a_revision_by_commit_hash_is_fetched(hub: FakeHub, tmp_path: Path) -> None:
    hub.repos["org/model"] = {"a.gguf": b"a" * 1000}
    commit = FakeHub.commit(hub.repos["org/model"])
    assert get(f"hf:org/model/a.gguf@{commit}", tmp_path).parent.name == commit


@pytest.mark.parametrize("gated", [False, True])
def test_a_repository_behind_a_token_asks_for_HF_TOKEN_and_opens_with_it(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gated: bool
) -> None:
    hub.repos["org/model"] = {"m.gguf": blob(1000)}
    hub.token, hub.gated = "s3cret", gated

    with pytest.raises(AssetError, match="set HF_TOKEN to a token") as caught:
        get("hf:org/model/m.gguf", tmp_path)
    assert ("is gated" in str(caught.value)) == gated

    monkeypatch.setenv("HF_TOKEN", "s3cret")
    assert get("hf:org/model/m.gguf", tmp_path).read_bytes() == blob(1000)
    (download,) = hub.requests("GET", "org/model", "m.gguf")
    assert download.headers["authorization"] == "Bearer s3cret"


def test_offline_the_cache_serves_both_forms_without_a_request(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub.repos["org/model"] = {"m-Q4_0.gguf": blob(1000, 1), "m-Q8_0.gguf": blob(1000, 2)}
    online = get("hf:org/model/m-Q8_0.gguf", tmp_path)
    asked = len(hub.calls)

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    assert get("hf:org/model/m-Q8_0.gguf", tmp_path) == online
    assert get("hf:org/model", tmp_path) == online
    assert len(hub.calls) == asked


@pytest.mark.parametrize(
    ("source", "missing"),
    [("hf:org/model/m.gguf", "org/model/m.gguf"), ("hf:org/model", "org/model@main")],
)
def test_offline_without_a_cached_copy_says_how_to_get_one(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, missing: str
) -> None:
    hub.repos["org/model"] = {"m.gguf": blob(1000)}
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    with pytest.raises(AssetError) as caught:
        get(source, tmp_path)

    assert str(caught.value) == (
        f"{source}: HF_HUB_OFFLINE is set and the cache at {tmp_path / 'hub'} has no "
        f"{missing}: run once online or copy it there"
    )
    assert hub.calls == []


@pytest.mark.parametrize(("variable", "below"), [("HF_HUB_CACHE", ""), ("HF_HOME", "hub")])
def test_the_hub_cache_set_in_the_environment_is_used(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variable: str, below: str
) -> None:
    hub.repos["org/model"] = {"m.gguf": blob(1000)}
    monkeypatch.setenv(variable, str(tmp_path / "shared"))

    path = get("hf:org/model/m.gguf", tmp_path / "ours")

    assert path.is_relative_to(tmp_path / "shared" / below / "models--org--model")
    assert not (tmp_path / "ours" / "hub").exists()


@pytest.mark.parametrize("source", ["hf:org/model/m.gguf", "hf:org/model"])
def test_an_unreachable_endpoint_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(time, "sleep", lambda _s: None)  # huggingface_hub's retries' backoff

    with pytest.raises(AssetError) as caught:
        get(source, tmp_path)

    message = str(caught.value)
    assert message.startswith(f"{source}: cannot fetch ")
    assert f"from {endpoint} (ConnectError: " in message
    assert message.endswith(
        "check the network, HF_ENDPOINT and any proxy, "
        "or set HF_HUB_OFFLINE=1 to use the cache alone"
    )


def test_a_full_disk_names_the_hub_cache(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The library's own error, raised where the download writes (no disk is filled)."""
    hub.repos["org/model"] = {"m.gguf": blob(1000)}

    def full(*_args: object, **_kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(huggingface_hub.file_download, "http_get", full)
    with pytest.raises(AssetError) as caught:
        get("hf:org/model/m.gguf", tmp_path)
    assert str(caught.value) == (
        f"hf:org/model/m.gguf: no space left for org/model/m.gguf in {tmp_path / 'hub'}: "
        "free some, or set HF_HUB_CACHE to a directory on a larger disk"
    )
