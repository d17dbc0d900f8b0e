"""llama.cpp's AMX kernels, kept out of the way on CPUs that have AMX (llama.cpp #20824).

Chosen by `--llama-amx`; how and why: docs/backends.md, "CPUs with AMX".
"""

from __future__ import annotations

import platform
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..settings import LlamaAmx

# llama.cpp's own variable for `--repack` / `--no-repack`; a flag given to the binary
# overrides it, so an operator's `--llama-args --repack` still wins.
SAFE_ENV = {"LLAMA_ARG_REPACK": "0"}
REPACK_FLAGS = ("--repack", "--no-repack", "-nr")
# GCC and Clang keep an explicit -mno-* over -march=native, in either order.
NO_AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
# How an AMX kernel fails: a bad address, or an instruction the OS has not enabled.
FAULT_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGILL})

# For a container whose llama-server we do not build (the upstream image carries every
# CPU variant, AMX included): `sh -c GUARD <binary> <args...>`. The container's own
# LLAMA_ARG_REPACK, when set, is the operator's choice and is left alone.
SHELL_GUARD = (
    'if [ -z "${LLAMA_ARG_REPACK+set}" ] && grep -qw amx_tile /proc/cpuinfo; '
    "then export LLAMA_ARG_REPACK=0; "
    'echo "CPU has AMX: LLAMA_ARG_REPACK=0 (rerank-server docs/backends.md)" >&2; '
    'fi; exec "$0" "$@"'
)


def cpu_has_amx(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether the CPU reports AMX tiles (`amx_tile` among its flags); False where the
    file cannot be read (not Linux)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return False
    return any(
        line.startswith("flags") and "amx_tile" in line.split() for line in text.splitlines()
    )


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def build_flags(mode: LlamaAmx) -> tuple[str, ...]:
    """CMake flags for the cache's build: without the AMX kernels unless `on` (only x86
    compilers know the `-mno-amx-*` options)."""
    if mode is LlamaAmx.ON or not is_x86():
        return ()
    return (f"-DCMAKE_C_FLAGS={NO_AMX_FLAGS}", f"-DCMAKE_CXX_FLAGS={NO_AMX_FLAGS}")


def operator_decides(args: Sequence[str], environ: Mapping[str, str]) -> bool:
    """Whether the operator set repacking themselves: in the arguments, or llama.cpp's
    variable in the environment."""
    return "LLAMA_ARG_REPACK" in environ or any(a in REPACK_FLAGS for a in args)


@dataclass(frozen=True)
class Decision:
    """How to start llama-server: `safe` passes SAFE_ENV; `fall_back` turns it on after a
    crash on a fault; `reason` is said once in the log."""

    safe: bool
    fall_back: bool
    reason: str

    def env(self, environ: Mapping[str, str]) -> dict[str, str] | None:
        """The child's environment, or None to inherit ours unchanged."""
        return {**environ, **SAFE_ENV} if self.safe else None


def decide(
    mode: LlamaAmx,
    *,
    amx_free_build: bool,
    args: Sequence[str],
    environ: Mapping[str, str],
    cpu_amx: bool | None = None,
) -> Decision:
    """How to start a llama-server with `args` and `environ`; `amx_free_build`: the binary
    is one of the cache's builds without AMX kernels; `cpu_amx` defaults to this CPU's."""
    if operator_decides(args, environ):
        return Decision(False, False, "the operator's LLAMA_ARG_REPACK or --repack/--no-repack")
    if mode is LlamaAmx.OFF:
        return Decision(True, False, "--llama-amx off")
    if mode is LlamaAmx.ON:
        return Decision(False, False, "--llama-amx on")
    if not (cpu_has_amx() if cpu_amx is None else cpu_amx):
        return Decision(False, True, "the CPU reports no AMX")
    if amx_free_build:
        return Decision(False, True, "the CPU has AMX; the cache's build has no AMX kernels")
    return Decision(True, False, "the CPU has AMX and this llama-server may have AMX kernels")
