"""Writing into the hub's cache as huggingface_hub lays it out: a download that the next
start resumes, under the blob's lock, checked against the sha256 the blob is named after
and linked into its snapshot atomically."""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from .downloads import AssetError, say, sha256_of
from .hub_progress import amount

if TYPE_CHECKING:
    from tqdm import tqdm as base_tqdm

    from .hub import Hub, HubSource

SHA256 = re.compile(r"[0-9a-f]{64}\Z")
COMMIT = re.compile(r"[0-9a-f]{40}\Z")


# Library internals used here, all for the cache layout, which is the library's to define
# and which every hub tool reads: `_create_symlink` (the snapshot's link, relative, or a
# move or copy where symlinks are not supported), `_cache_commit_hash_for_specific_revision`
# (`refs/`, written atomically) and `_create_cachedir_tag`. Copied here they would drift
# from the library unseen; imported, a release that changes them fails at the import or in
# tests/service/test_hub.py.
def resumable(
    source: HubSource, filename: str, hub: Hub, bar: type[base_tqdm[Any]], marks: Path
) -> Path | None:
    """The file in the hub cache, downloaded when missing by a download that a later fetch
    resumes (`blobs/<sha256>.rerank-partial`) and checked before it is placed; None leaves
    the fetch to `hf_hub_download`, which falls back on the cache or raises what
    `hub._explain` words when the hub cannot be asked, and serves a file without a sha256.

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
    if COMMIT.match(source.revision):
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
        return None  # hf_hub_download asks again and answers as it would alone
    etag, commit, size = meta.etag or "", meta.commit_hash or "", meta.size
    if not (SHA256.match(etag) and COMMIT.match(commit)) or ".." in parts or size is None:
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


def verify(path: Path, source: HubSource, filename: str, marks: Path) -> None:
    """Check the file against the sha256 the hub gave for it, which the cache names its
    blob after, the first time this blob is used; delete it when it does not match.

    A mark in `marks` (the blob's size and mtime) records a blob that matched, so the hash
    is computed once, not at each start; a blob that lost its mark (the process ended
    between the download and the check) is checked again. A file kept in git, whose blob
    is named after its git hash, and a cache without symlinks give no sha256 to check.
    """
    blob = path.resolve()
    if not SHA256.match(blob.name):
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
    say(f"checking the sha256 of {source.repo}/{filename} ({amount(file.stat().st_size)})")
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
