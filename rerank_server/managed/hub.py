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

The resumed download and the checks are in `hub_cache.py`, the progress in
`hub_progress.py`. huggingface_hub is imported by the functions that use it: only `hf:`
sources pay for its import.
"""

from __future__ import annotations

import errno
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ..errors import ConfigError
from .downloads import AssetError, say
from .hub_cache import COMMIT, resumable, verify
from .hub_progress import Transfer, bar_class, lines_class

_FORM = "hf:ORG/REPO[/FILE.gguf][@REVISION]"
_DEFAULT_ENDPOINT = "https://huggingface.co"
# Parts of one model written as several files; llama-server loads them from the first
# part, but fetching a set is not supported.
_SPLIT = re.compile(r"-\d{5}-of-\d{5}\.gguf\Z", re.IGNORECASE)
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
    hub = Hub.from_environ(cache)
    filename = source.filename or _choose(source, hub)
    if progress is None:
        progress = sys.stderr.isatty()
    marks = cache / "hub-verified"
    path = _download(source, filename, hub, progress, marks)
    verify(path, source, filename, marks)
    return path


@dataclass(frozen=True)
class Hub:
    """The hub settings of one fetch, read from the environment when it starts."""

    endpoint: str
    token: str | None  # None: huggingface_hub's own (`hf auth login`), if any
    offline: bool
    cache_dir: Path

    @classmethod
    def from_environ(cls, cache: Path) -> Hub:
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


def _choose(source: HubSource, hub: Hub) -> str:
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


def _listed_files(source: HubSource, hub: Hub) -> list[str]:
    from huggingface_hub import HfApi

    api = HfApi(endpoint=hub.endpoint, token=hub.token)
    try:
        info = api.model_info(source.repo, revision=source.revision, timeout=_LIST_TIMEOUT_S)
    except Exception as error:
        raise _explain(error, source, None, hub) from error
    return [sibling.rfilename for sibling in info.siblings or []]


def _cached_files(source: HubSource, hub: Hub) -> list[str]:
    """The files of the source's revision in the hub cache (its snapshot folder)."""
    from huggingface_hub.file_download import repo_folder_name

    storage = hub.cache_dir / repo_folder_name(repo_id=source.repo, repo_type="model")
    commit: str | None = source.revision
    if not COMMIT.match(source.revision):
        try:
            commit = (storage / "refs" / source.revision).read_text().strip()
        except OSError:
            commit = None
    snapshot = storage / "snapshots" / commit if commit else None
    if snapshot is None or not snapshot.is_dir():
        raise AssetError(_offline(source, hub, f"{source.repo}@{source.revision}"))
    # is_file() follows the link: a file whose blob was deleted is not there.
    return [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()]


def _offline(source: HubSource, hub: Hub, what: str) -> str:
    return (
        f"{source}: HF_HUB_OFFLINE is set and the cache at {hub.cache_dir} has no {what}: "
        "run once online or copy it there"
    )


def _download(source: HubSource, filename: str, hub: Hub, progress: bool, marks: Path) -> Path:
    from huggingface_hub import hf_hub_download

    transfer = Transfer(f"{source.repo}/{filename}", hub.endpoint, lines=not progress)
    bar = bar_class(transfer) if progress else lines_class(transfer)
    try:
        path = None if hub.offline else resumable(source, filename, hub, bar, marks)
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


def _explain(error: Exception, source: HubSource, filename: str | None, hub: Hub) -> AssetError:
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


def _ggufs_of(source: HubSource, hub: Hub) -> str:
    """The repository's GGUF files, for an error that names a file it does not have."""
    try:
        names = _listed_files(source, hub)
    except AssetError:
        return "name one of its GGUF files"
    # Only names that stay inside the repository's folder: the listing is the
    # endpoint's word, and a name becomes a path in the cache.
    ggufs = sorted(n for n in names if n.lower().endswith(".gguf") and _inside(n))
    return f"its GGUF files: {', '.join(ggufs)}" if ggufs else "it has no GGUF file"
