"""Models named on the Hugging Face hub (`--model NAME=hf:ORG/REPO[/FILE.gguf][@REVISION]`),
fetched into the hub's own cache with huggingface_hub's pieces.

The library resolves the file, speaks the hub's protocol (endpoint, token, redirects, a
dropped connection retried with a Range request for the rest) and defines the cache layout
every other hub tool reads. Its own download, `hf_hub_download`, writes to a temporary file
of a random name that it deletes when the call fails, so a download ended with the process
(Ctrl-C, a killed pod) would start from zero at the next start. Here the file is received
by the library's `http_get` into a partial file of a stable name that the next start
resumes, checked against the hub's sha256, and placed into the cache as the library places
a blob; `hf_hub_download` still serves offline starts and what a resumed download cannot
(a hub that cannot be asked, a file without a sha256). This module also adds what the
library leaves to its caller: the environment read at each call (the library reads
HF_ENDPOINT and HF_HUB_OFFLINE once, at import), the choice of a file when a source names
only the repository, the sha256 check (the library checks only the size), progress lines
when stderr is not a terminal, and errors that say what to do.

huggingface_hub is imported by the functions that use it: only `hf:` sources pay for
its import.
"""

from __future__ import annotations

import errno
import os
import re
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

import structlog

from ..errors import ConfigError
from .downloads import AssetError, say, sha256_of

log = structlog.get_logger(__name__)

if TYPE_CHECKING:
    from tqdm import tqdm as base_tqdm

_FORM = "hf:ORG/REPO[/FILE.gguf][@REVISION]"
_DEFAULT_ENDPOINT = "https://huggingface.co"
# Parts of one model written as several files; llama-server loads them from the first
# part, but fetching a set is not supported.
_SPLIT = re.compile(r"-\d{5}-of-\d{5}\.gguf\Z", re.IGNORECASE)
_SHA256 = re.compile(r"[0-9a-f]{64}\Z")
_COMMIT = re.compile(r"[0-9a-f]{40}\Z")
# The listing is one small request; model_info waits forever without a timeout.
_LIST_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class HubSource:
    """A GGUF on the hub: `repo` (`ORG/REPO`), `filename` (a path in the repository, or
    None to choose one when fetching) and `revision` (a branch, tag or commit hash)."""

    repo: str
    filename: str | None
    revision: str = "main"

    @classmethod
    def parse(cls, source: str) -> HubSource:
        """`hf:ORG/REPO[/FILE.gguf][@REVISION]`; the revision is what follows the last `@`.
        Raises ConfigError naming `source` when it is not of that form."""
        from huggingface_hub.errors import HFValidationError

        # Public (the library's docs import it from here), but not re-exported for mypy.
        from huggingface_hub.utils import validate_repo_id  # type: ignore[attr-defined]

        def bad(problem: str) -> ConfigError:
            return ConfigError(f"model source {source!r}: {problem} (expected {_FORM})")

        if not source.startswith("hf:"):
            raise bad("a hub source starts with hf:")
        path, at, revision = source.removeprefix("hf:").rpartition("@")
        if not at:
            path, revision = revision, "main"
        if not revision:
            raise bad("empty revision after @")
        steps = revision.split("/")
        if revision.startswith("/") or "" in steps or "." in steps or ".." in steps:
            # It becomes a path in the cache (refs/REVISION): it must stay inside.
            raise bad(f"{revision!r} is not a branch, tag or commit")
        parts = path.split("/")
        if len(parts) < 2 or "" in parts or "." in parts or ".." in parts:
            raise bad("expected an organisation and a repository")
        repo, filename = "/".join(parts[:2]), "/".join(parts[2:]) or None
        try:
            validate_repo_id(repo)
        except HFValidationError as error:
            raise bad(str(error)) from None
        if filename is not None and not filename.lower().endswith(".gguf"):
            raise bad(f"{filename} is not a .gguf file")
        if filename is not None and _SPLIT.search(filename):
            raise bad(
                f"{filename} is one part of a split GGUF, which is not supported: "
                "name a quantisation published as a single file"
            )
        return cls(repo, filename, revision)

    def __str__(self) -> str:
        file = f"/{self.filename}" if self.filename else ""
        revision = f"@{self.revision}" if self.revision != "main" else ""
        return f"hf:{self.repo}{file}{revision}"


def fetch(source: HubSource, cache: Path, *, progress: bool | None = None) -> Path:
    """The GGUF as a local path, downloaded into the hub cache when missing.

    The hub cache is HF_HUB_CACHE, else HF_HOME/hub, else `cache/hub`; HF_ENDPOINT,
    HF_TOKEN and HF_HUB_OFFLINE are read at each call. A source without a file name takes
    the repository's one GGUF, or its one Q8_0 GGUF (offline: among those cached), and
    says which. `progress`: huggingface_hub's bar (True), a `say` line at each tenth
    (False), or the bar when stderr is a terminal (None). A file is checked against the
    hub's sha256 the first time it is used and deleted when it does not match. A download
    ended with the process (Ctrl-C, a killed pod) is resumed by the next fetch, and one that
    another process has begun is waited for. Raises AssetError naming the source and saying
    what to do.
    """
    hub = _Hub.from_environ(cache)
    filename = source.filename or _choose(source, hub)
    if progress is None:
        progress = sys.stderr.isatty()
    marks = cache / "hub-verified"
    path = _download(source, filename, hub, progress, marks)
    _verify(path, source, filename, marks)
    return path


@dataclass(frozen=True)
class _Hub:
    """The hub settings of one fetch, read from the environment when it starts."""

    endpoint: str
    token: str | None  # None: huggingface_hub's own (`hf auth login`), if any
    offline: bool
    cache_dir: Path

    @classmethod
    def from_environ(cls, cache: Path) -> _Hub:
        env = os.environ
        if env.get("HF_HUB_CACHE"):
            cache_dir = Path(os.path.expandvars(env["HF_HUB_CACHE"])).expanduser()
        elif env.get("HF_HOME"):
            cache_dir = Path(os.path.expandvars(env["HF_HOME"])).expanduser() / "hub"
        else:
            cache_dir = cache / "hub"
        return cls(
            endpoint=(env.get("HF_ENDPOINT") or _DEFAULT_ENDPOINT).rstrip("/"),
            token=env.get("HF_TOKEN") or None,
            # The values huggingface_hub takes as true.
            offline=env.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"},
            cache_dir=cache_dir,
        )


def _choose(source: HubSource, hub: _Hub) -> str:
    """The GGUF to fetch for a source that names only the repository."""
    names = _cached_files(source, hub) if hub.offline else _listed_files(source, hub)
    # Only names that stay inside the repository's folder: the listing is the
    # endpoint's word, and a name becomes a path in the cache.
    ggufs = sorted(n for n in names if n.lower().endswith(".gguf") and _inside(n))
    # A vision model's projector is a GGUF too, but never the model to serve.
    whole = [
        n
        for n in ggufs
        if not _SPLIT.search(n) and not PurePosixPath(n).name.lower().startswith("mmproj")
    ]
    q8_0 = [n for n in whole if "q8_0" in n.lower()]
    if len(whole) == 1:
        say(f"{source}: taking {whole[0]}, its only GGUF file")
        return whole[0]
    if len(q8_0) == 1:
        say(f"{source}: taking {q8_0[0]}, the Q8_0 one of its {len(whole)} GGUF files")
        return q8_0[0]
    has = (
        f"the cache at {hub.cache_dir} holds"
        if hub.offline
        else f"{source.repo} at {source.revision} on {hub.endpoint} has"
    )
    if not ggufs:
        raise AssetError(f"{source}: {has} no GGUF file")
    if not whole:
        raise AssetError(
            f"{source}: {has} only split GGUF files ({', '.join(ggufs)}), which are not "
            "supported: name a model published as a single GGUF"
        )
    which = "none" if not q8_0 else "several"
    raise AssetError(
        f"{source}: {has} {len(whole)} GGUF files and {which} of them Q8_0; name one as "
        f"hf:{source.repo}/FILE.gguf: {', '.join(whole)}"
    )


def _inside(name: str) -> bool:
    """Whether a file name of a listing is a relative path with no `.` or `..` steps."""
    steps = name.split("/")
    return not name.startswith("/") and "" not in steps and "." not in steps and ".." not in steps


def _listed_files(source: HubSource, hub: _Hub) -> list[str]:
    from huggingface_hub import HfApi

    api = HfApi(endpoint=hub.endpoint, token=hub.token)
    try:
        info = api.model_info(source.repo, revision=source.revision, timeout=_LIST_TIMEOUT_S)
    except Exception as error:
        raise _explain(error, source, None, hub) from error
    return [sibling.rfilename for sibling in info.siblings or []]


def _cached_files(source: HubSource, hub: _Hub) -> list[str]:
    """The files of the source's revision in the hub cache (its snapshot folder)."""
    from huggingface_hub.file_download import repo_folder_name

    storage = hub.cache_dir / repo_folder_name(repo_id=source.repo, repo_type="model")
    commit: str | None = source.revision
    if not _COMMIT.match(source.revision):
        try:
            commit = (storage / "refs" / source.revision).read_text().strip()
        except OSError:
            commit = None
    snapshot = storage / "snapshots" / commit if commit else None
    if snapshot is None or not snapshot.is_dir():
        raise AssetError(_offline(source, hub, f"{source.repo}@{source.revision}"))
    # is_file() follows the link: a file whose blob was deleted is not there.
    return [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()]


def _offline(source: HubSource, hub: _Hub, what: str) -> str:
    return (
        f"{source}: HF_HUB_OFFLINE is set and the cache at {hub.cache_dir} has no {what}: "
        "run once online or copy it there"
    )


def _download(source: HubSource, filename: str, hub: _Hub, progress: bool, marks: Path) -> Path:
    from huggingface_hub import hf_hub_download

    transfer = _Transfer(f"{source.repo}/{filename}", hub.endpoint, lines=not progress)
    bar = _bar_class(transfer) if progress else _lines_class(transfer)
    try:
        path = None if hub.offline else _resumable(source, filename, hub, bar, marks)
        if path is None:
            path = Path(
                hf_hub_download(
                    source.repo,
                    filename,
                    revision=source.revision,
                    cache_dir=hub.cache_dir,
                    endpoint=hub.endpoint,
                    token=hub.token,
                    # The library's own offline switch was read at import, not now.
                    local_files_only=hub.offline,
                    tqdm_class=bar,
                )
            )
    except Exception as error:
        raise _explain(error, source, filename, hub) from error
    transfer.finish()
    return path


# Library internals used here, all for the cache layout, which is the library's to define
# and which every hub tool reads: `_create_symlink` (the snapshot's link, relative, or a
# move or copy where symlinks are not supported), `_cache_commit_hash_for_specific_revision`
# (`refs/`, written atomically) and `_create_cachedir_tag`. Copied here they would drift
# from the library unseen; imported, a release that changes them fails at the import or in
# tests/service/test_hub.py.
def _resumable(
    source: HubSource, filename: str, hub: _Hub, bar: type[base_tqdm[Any]], marks: Path
) -> Path | None:
    """The file in the hub cache, downloaded when missing by a download that a later fetch
    resumes (`blobs/<sha256>.rerank-partial`) and checked before it is placed; None leaves
    the fetch to `hf_hub_download`, which falls back on the cache or raises what
    `_explain` words when the hub cannot be asked, and serves a file without a sha256.

    Always plain HTTP, never Xet (docs/decisions.md, "Models from the hub through
    huggingface_hub"): hf_xet keeps nothing of an interrupted download for the next start.
    """
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
    from huggingface_hub._local_folder import _create_cachedir_tag
    from huggingface_hub.file_download import repo_folder_name

    # Public (the library's docs import it from here), but not re-exported for mypy.
    from huggingface_hub.utils import build_hf_headers  # type: ignore[attr-defined]

    # Resolved as hf_hub_download resolves it, so that both name a file alike.
    cache_dir = hub.cache_dir.expanduser().resolve()
    storage = cache_dir / repo_folder_name(repo_id=source.repo, repo_type="model")
    parts = PurePosixPath(filename).parts
    if _COMMIT.match(source.revision):
        pinned = storage.joinpath("snapshots", source.revision, *parts)
        if pinned.exists():
            return pinned  # as hf_hub_download does: a commit's file never changes
    # The header hf_hub_download's requests carry, by which the hub counts downloads.
    headers = build_hf_headers(token=hub.token, headers={constants.X_HF_DOWNLOAD_COUNTER: "1"})
    try:
        meta = get_hf_file_metadata(
            hf_hub_url(source.repo, filename, revision=source.revision, endpoint=hub.endpoint),
            token=hub.token,
            headers=headers,
            endpoint=hub.endpoint,
        )
    except Exception:
        return None  # hf_hub_download asks again and does what it does today
    etag, commit, size = meta.etag or "", meta.commit_hash or "", meta.size
    if not (_SHA256.match(etag) and _COMMIT.match(commit)) or ".." in parts or size is None:
        return None
    if size > constants.MAX_HTTP_DOWNLOAD_SIZE:
        return None  # the hub serves a file this large through Xet alone
    blob = storage / "blobs" / etag
    pointer = storage.joinpath("snapshots", commit, *parts)
    if pointer.exists():
        _cache_ref(storage, source.revision, commit, best_effort=True)
        return pointer
    label = f"{source.repo}/{filename}"
    # The lock hf_hub_download takes for this blob, so that its downloads and ours wait
    # for each other too.
    with _exclusive(cache_dir / ".locks" / storage.name / f"{etag}.lock", label):
        new_blob = not blob.exists()
        if new_blob:
            # Pinned to the commit: every attempt gets the bytes this answer described, and
            # a redirect to the CDN is signed anew for each.
            url = hf_hub_url(source.repo, filename, revision=commit, endpoint=hub.endpoint)
            _create_cachedir_tag(cache_dir)  # as hf_hub_download does: backups skip the cache
            _receive(url, blob, size, headers, bar, source, filename)
            _mark(blob, marks)
        if not pointer.exists():
            _link(blob, pointer, new_blob)
    _cache_ref(storage, source.revision, commit, best_effort=False)
    return pointer


# Long enough for an idle lock to be taken at once; past it, the wait is said.
_LOCK_TRY_S = 0.2


@contextmanager
def _exclusive(lock: Path, label: str) -> Iterator[None]:
    """Hold one blob's lock: a second process downloading the same file (a replica sharing
    the cache volume) waits for the first, then finds the blob."""
    from filelock import Timeout  # huggingface_hub's lock library, which WeakFileLock raises

    # The library's own lock (flock, or a lock file where a file system has none); not
    # re-exported for mypy, as build_hf_headers.
    from huggingface_hub.utils import WeakFileLock  # type: ignore[attr-defined]

    lock.parent.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        try:
            stack.enter_context(WeakFileLock(lock, timeout=_LOCK_TRY_S))
        except Timeout:
            say(f"{label}: waiting for another process that is downloading it")
            stack.enter_context(WeakFileLock(lock))
        yield


def _receive(
    url: str,
    blob: Path,
    size: int,
    headers: dict[str, str],
    bar: type[base_tqdm[Any]],
    source: HubSource,
    filename: str,
) -> None:
    """Download into `<blob>.rerank-partial` from its current size on, check it against the
    sha256 the blob is named after, and move it into place. Called under the blob's lock.

    The partial keeps a stable name beside the blobs: the next start finds it, and the move
    into place is a rename within one directory. A partial that fails the check is deleted.
    """
    from huggingface_hub.file_download import http_get

    blob.parent.mkdir(parents=True, exist_ok=True)
    _remove_library_temp_files(blob)
    partial = blob.with_name(f"{blob.name}.rerank-partial")
    with partial.open("ab") as file:
        if file.tell() > size:  # not the start of this file
            file.seek(0)
            file.truncate()
        # Sends `Range: bytes=N-` and starts over if the answer is the whole file (200);
        # returns at once when the partial is already whole.
        http_get(
            url, file, resume_size=file.tell(), headers=headers, expected_size=size, tqdm_class=bar
        )
    _check_sha256(partial, source, filename)
    os.replace(partial, blob)


def _remove_library_temp_files(blob: Path) -> None:
    """Delete hf_hub_download's temporary files of this blob (`<sha256>.<8 hex>.incomplete`),
    which a killed process leaves behind: it never reuses them, so they only fill the disk.
    A live download of the library holds the blob's lock, which the caller holds."""
    mine = re.compile(rf"{blob.name}(\.[0-9a-f]{{8}})?\.incomplete\Z")
    for path in blob.parent.glob(f"{blob.name}*.incomplete"):
        if mine.match(path.name):
            path.unlink(missing_ok=True)


def _link(blob: Path, pointer: Path, new_blob: bool) -> None:
    """The snapshot's entry for the file, made under a temporary name then renamed over
    `pointer`, so that no reader sees it missing or half made. `_create_symlink` makes the
    link relative (a moved cache keeps working) and, where symlinks are not supported,
    moves a new blob there or copies a shared one, as the library does."""
    from huggingface_hub.file_download import _create_symlink

    pointer.parent.mkdir(parents=True, exist_ok=True)
    temp = pointer.with_name(f".{pointer.name}.{uuid.uuid4().hex[:8]}.link")
    try:
        _create_symlink(str(blob), str(temp), new_blob=new_blob)
        os.replace(temp, pointer)
    finally:
        temp.unlink(missing_ok=True)


def _cache_ref(storage: Path, revision: str, commit: str, *, best_effort: bool) -> None:
    """`refs/<revision>` naming the commit when the revision is a branch or tag: where an
    offline start looks the revision up. `best_effort`: a cache mounted read-only, whose file
    is already there, is served without it, as hf_hub_download does."""
    from huggingface_hub.file_download import _cache_commit_hash_for_specific_revision

    try:
        _cache_commit_hash_for_specific_revision(str(storage), revision, commit)
    except OSError:
        if not best_effort:
            raise


@dataclass
class _Transfer:
    """One download as its progress bar sees it: huggingface_hub makes the bar only when it
    downloads, so a fetch from the cache says nothing. Without a bar (`lines`), each step
    is also a `model_download` log event whose fields a log shipper reads: `phase` (start,
    resume, progress, done), `file`, `done_bytes`, `total_bytes`, `percent`, `seconds`."""

    label: str
    endpoint: str
    lines: bool = False
    size: float | None = None
    started: float | None = None
    tenths: int = 0  # the last tenth said

    def begin(self, size: float | None, initial: float = 0) -> None:
        """`initial`: the bytes an earlier start left, which this download resumes from."""
        # A retried download keeps its bar, but a Xet one makes two.
        if self.started is not None:
            return
        self.started, self.size = time.monotonic(), size
        self._event("resume" if initial and size else "start", initial, endpoint=self.endpoint)
        if initial and size:
            self.tenths = int(10 * initial / size)
            say(
                f"resuming {self.label} at {_amount(initial)} of {_amount(size)} "
                f"from {self.endpoint}"
            )
            return
        of = f" ({_amount(size)})" if size else ""
        say(f"downloading {self.label}{of} from {self.endpoint}")

    def report(self, done: float, size: float | None) -> None:
        tenths = int(10 * done / size) if size else 0
        if self.tenths < tenths < 10 and size:
            self.tenths = tenths
            self._event("progress", done)
            say(f"downloading {self.label}: {10 * tenths}% ({_amount(done)} of {_amount(size)})")

    def finish(self) -> None:
        if self.started is None:
            return
        took = time.monotonic() - self.started
        self._event("done", self.size, seconds=round(took, 3))
        of = f": {_amount(self.size)}" if self.size else ""
        say(f"downloaded {self.label}{of} in {took:.1f} s")

    def _event(self, phase: str, done: float | None, **fields: Any) -> None:
        if not self.lines:
            return  # a log line would break into the bar's redraws
        total = int(self.size) if self.size else None
        log.info(
            "model_download",
            phase=phase,
            file=self.label,
            done_bytes=int(done or 0),
            total_bytes=total,
            percent=round(100 * (done or 0) / total, 1) if total else None,
            **fields,
        )


def _amount(size: float) -> str:
    return f"{size / 1e9:.2f} GB" if size >= 1e9 else f"{size / 1e6:.1f} MB"


def _lines_class(transfer: _Transfer) -> type[base_tqdm[Any]]:
    from huggingface_hub.utils.tqdm import tqdm

    class Lines(tqdm):
        """No bar: a `say` line at each tenth, for logs that a bar's redraws would garble."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            transfer.begin(kwargs.get("total"), kwargs.get("initial") or 0)
            kwargs["disable"] = True  # tqdm draws nothing; `update` counts
            super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]

        def update(self, n: float | None = 1) -> bool | None:
            self.n += n or 0
            transfer.report(self.n, self.total)
            return None

        def update_transfer(self, n: float) -> None:
            """Bytes off the network, which a Xet download counts apart from bytes written:
            with this method it reports both to one bar, and only the written are said."""

        def set_transfer_postfix_str(self, s: str = "", refresh: bool = True) -> None:
            """The network rate of a Xet download, which the lines leave out."""

    return Lines


def _bar_class(transfer: _Transfer) -> type[base_tqdm[Any]]:
    from huggingface_hub.utils.tqdm import tqdm

    class Bar(tqdm):
        """huggingface_hub's bar, which also tells `transfer` that a download began."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            transfer.begin(kwargs.get("total"), kwargs.get("initial") or 0)
            # A plain HTTP download is labelled with its URL, cut to its last 40 characters.
            if kwargs.get("name") == "huggingface_hub.http_get":
                kwargs["desc"] = transfer.label
            if kwargs.get("disable") is None:
                kwargs["disable"] = False  # a bar was asked for, terminal or not
            super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]

    return Bar


def _verify(path: Path, source: HubSource, filename: str, marks: Path) -> None:
    """Check the file against the sha256 the hub gave for it, which the cache names its
    blob after, the first time this blob is used; delete it when it does not match.

    A mark in `marks` (the blob's size and mtime) records a blob that matched, so the hash
    is computed once, not at each start; a blob that lost its mark (the process ended
    between the download and the check) is checked again. A file kept in git, whose blob
    is named after its git hash, and a cache without symlinks give no sha256 to check.
    """
    blob = path.resolve()
    if not _SHA256.match(blob.name):
        return
    try:
        if (marks / blob.name).read_text() == _stamp(blob):
            return
    except OSError:
        pass
    try:
        _check_sha256(blob, source, filename)
    except AssetError:
        path.unlink(missing_ok=True)
        raise
    _mark(blob, marks)


def _check_sha256(file: Path, source: HubSource, filename: str) -> None:
    """Raise AssetError, having deleted `file`, unless its sha256 is the one its blob is
    named after (the name before the first dot)."""
    expected = file.name.split(".")[0]
    say(f"checking the sha256 of {source.repo}/{filename} ({_amount(file.stat().st_size)})")
    actual = sha256_of(file)
    if actual != expected:
        file.unlink(missing_ok=True)
        raise AssetError(
            f"{source}: {filename} does not match the sha256 the hub gives for it "
            f"({actual}, not {expected}), so it was deleted from {file.parent.parent}: "
            "run again to download it anew"
        )


def _stamp(blob: Path) -> str:
    stat = blob.stat()
    return f"{stat.st_size} {stat.st_mtime_ns}"


def _mark(blob: Path, marks: Path) -> None:
    """Record that `blob` matched its sha256."""
    try:
        marks.mkdir(parents=True, exist_ok=True)
        (marks / blob.name).write_text(_stamp(blob))
    except OSError:
        pass  # unmarked, it is checked again next time


def _explain(error: Exception, source: HubSource, filename: str | None, hub: _Hub) -> AssetError:
    """An AssetError for what huggingface_hub raised, naming the source and what to do."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(error, AssetError):
        return error
    what = f"{source.repo}/{filename}" if filename else source.repo
    if hub.offline and isinstance(error, LocalEntryNotFoundError):
        return AssetError(_offline(source, hub, what))
    # Without a cached copy to fall back on, the library raises this over why the hub
    # could not be asked.
    cause = error
    if isinstance(error, LocalEntryNotFoundError) and isinstance(error.__cause__, Exception):
        cause = error.__cause__
    if isinstance(cause, GatedRepoError):
        return AssetError(
            f"{source}: {source.repo} on {hub.endpoint} is gated: accept its conditions on "
            "its page there, then set HF_TOKEN to a token of that account"
        )
    if isinstance(cause, RepositoryNotFoundError):
        return AssetError(
            f"{source}: no repository {source.repo} on {hub.endpoint} (a private one looks "
            "the same without access: set HF_TOKEN to a token that can read it)"
        )
    if isinstance(cause, RevisionNotFoundError):
        return AssetError(
            f"{source}: {source.repo} has no revision {source.revision!r} on {hub.endpoint}"
        )
    if isinstance(cause, RemoteEntryNotFoundError):
        return AssetError(
            f"{source}: {source.repo} has no {filename} at {source.revision} on "
            f"{hub.endpoint}; {_ggufs_of(source, hub)}"
        )
    if isinstance(cause, HfHubHTTPError) and cause.response.status_code in (401, 403):
        return AssetError(
            f"{source}: {hub.endpoint} refused {what} (HTTP {cause.response.status_code}): "
            f"set HF_TOKEN to a token that can read {source.repo}"
        )
    if isinstance(cause, HfHubHTTPError):
        return AssetError(
            f"{source}: {hub.endpoint} answered HTTP {cause.response.status_code} for {what}: "
            "try again later, or set HF_HUB_OFFLINE=1 to use a cached copy"
        )
    if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
        return AssetError(
            f"{source}: no space left for {what} in {hub.cache_dir}: free some, or set "
            "HF_HUB_CACHE to a directory on a larger disk"
        )
    return AssetError(
        f"{source}: cannot fetch {what} from {hub.endpoint} ({type(cause).__name__}: "
        f"{cause}): check the network, HF_ENDPOINT and any proxy, or set HF_HUB_OFFLINE=1 "
        "to use the cache alone"
    )


def _ggufs_of(source: HubSource, hub: _Hub) -> str:
    """The repository's GGUF files, for an error that names a file it does not have."""
    try:
        names = _listed_files(source, hub)
    except AssetError:
        return "name one of its GGUF files"
    # Only names that stay inside the repository's folder: the listing is the
    # endpoint's word, and a name becomes a path in the cache.
    ggufs = sorted(n for n in names if n.lower().endswith(".gguf") and _inside(n))
    return f"its GGUF files: {', '.join(ggufs)}" if ggufs else "it has no GGUF file"
