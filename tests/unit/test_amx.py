"""How llama-server is kept out of llama.cpp's AMX kernels (managed/amx.py): the decision
per mode, the CPU check, the cache's build flavours, and the guard the manifests run."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from rerank_server.managed import amx, llama_build
from rerank_server.settings import LlamaAmx

NO_ENV: dict[str, str] = {}


@pytest.mark.parametrize(
    ("mode", "cpu_amx", "amx_free", "safe", "fall_back"),
    [
        (LlamaAmx.AUTO, False, False, False, True),  # no AMX: repacking stays on
        (LlamaAmx.AUTO, True, True, False, True),  # AMX CPU, our build without the kernels
        (LlamaAmx.AUTO, True, False, True, False),  # AMX CPU, a binary built elsewhere
        (LlamaAmx.OFF, False, True, True, False),
        (LlamaAmx.ON, True, False, False, False),
    ],
)
def test_the_safe_setting_goes_where_amx_kernels_may_run(
    mode: LlamaAmx, cpu_amx: bool, amx_free: bool, safe: bool, fall_back: bool
) -> None:
    decision = amx.decide(mode, amx_free_build=amx_free, args=[], environ=NO_ENV, cpu_amx=cpu_amx)
    assert (decision.safe, decision.fall_back) == (safe, fall_back)
    env = decision.env({"PATH": "/bin"})
    assert env == ({"PATH": "/bin", "LLAMA_ARG_REPACK": "0"} if safe else None)


@pytest.mark.parametrize(
    ("args", "environ"),
    [
        (["--repack"], NO_ENV),
        (["-t", "4", "--no-repack"], NO_ENV),
        (["-nr"], NO_ENV),
        ([], {"LLAMA_ARG_REPACK": "1"}),
    ],
)
def test_the_operators_own_repack_setting_is_left_alone(
    args: list[str], environ: dict[str, str]
) -> None:
    for mode in LlamaAmx:
        decision = amx.decide(mode, amx_free_build=False, args=args, environ=environ, cpu_amx=True)
        assert not decision.safe and not decision.fall_back, mode


def test_amx_is_read_from_the_cpu_flags(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx512f amx_bf16 amx_tile amx_int8\n")
    assert amx.cpu_has_amx(cpuinfo)
    cpuinfo.write_text(
        "processor\t: 0\nflags\t\t: fpu avx512f avx512_vnni\n"
        "bugs\t\t: amx_tile_is_not_a_flag_here\n"
    )
    assert not amx.cpu_has_amx(cpuinfo)
    assert not amx.cpu_has_amx(tmp_path / "missing")


def test_each_amx_flavour_of_the_cache_build_has_its_own_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build with AMX kernels is never taken for one without: the path says which."""
    monkeypatch.delenv("RERANK_LLAMA_NATIVE", raising=False)
    auto = llama_build.cached_llama_server(tmp_path, LlamaAmx.AUTO)
    assert llama_build.cached_llama_server(tmp_path, LlamaAmx.OFF) == auto
    with_amx = llama_build.cached_llama_server(tmp_path, LlamaAmx.ON)
    monkeypatch.setenv("RERANK_LLAMA_NATIVE", "0")
    portable = llama_build.cached_llama_server(tmp_path, LlamaAmx.ON)
    assert llama_build.is_amx_free_build(portable, tmp_path)
    assert not llama_build.is_amx_free_build(with_amx, tmp_path)
    if amx.is_x86():
        assert len({auto, with_amx, portable}) == 3
        assert llama_build.is_amx_free_build(auto, tmp_path)


def test_the_build_flags_keep_amx_out_where_march_would_enable_it() -> None:
    """The cache's build passes `-march=native` and NO_AMX_FLAGS: on an AMX CPU, native
    means Sapphire Rapids, and the compiler must still define no AMX macro (every AMX
    path in ggml is behind `__AMX_INT8__`). Elsewhere there is no AMX and no flag."""
    assert amx.build_flags(LlamaAmx.ON) == ()
    if not amx.is_x86():
        assert amx.build_flags(LlamaAmx.AUTO) == ()
        return
    compiler = shutil.which("c++") or shutil.which("g++")
    assert compiler, "the build needs a C++ compiler"
    flags = dict(f.removeprefix("-D").split("=", 1) for f in amx.build_flags(LlamaAmx.AUTO))
    macros = subprocess.run(
        [
            compiler,
            "-march=sapphirerapids",
            *shlex.split(flags["CMAKE_CXX_FLAGS"]),
            "-dM",
            "-E",
            "-x",
            "c++",
            "-",
        ],
        input="",
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "__AVX512VNNI__" in macros and "__AMX" not in macros


def _guarded(tmp_path: Path, env: dict[str, str], cpu_amx: bool) -> str:
    """What a binary run through SHELL_GUARD sees of LLAMA_ARG_REPACK, and its arguments;
    `cpu_amx` stands in for the CPU by a `grep` that finds (or not) `amx_tile`."""
    binary = tmp_path / "llama-server"
    binary.write_text('#!/bin/sh\necho "repack=${LLAMA_ARG_REPACK-unset} args=$*"\n')
    binary.chmod(0o755)
    tools = tmp_path / "bin"
    tools.mkdir(exist_ok=True)
    grep = tools / "grep"
    grep.write_text(f"#!/bin/sh\nexit {0 if cpu_amx else 1}\n")
    grep.chmod(0o755)
    out = subprocess.run(
        ["/bin/sh", "-c", amx.SHELL_GUARD, str(binary), "--port", "8080"],
        env={"PATH": f"{tools}:{os.environ['PATH']}", **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def test_the_manifests_guard_turns_repacking_off_only_on_an_amx_cpu(tmp_path: Path) -> None:
    assert _guarded(tmp_path, {}, cpu_amx=True) == "repack=0 args=--port 8080"
    assert _guarded(tmp_path, {}, cpu_amx=False) == "repack=unset args=--port 8080"
    # The container's own setting is the operator's: kept either way.
    assert (
        _guarded(tmp_path, {"LLAMA_ARG_REPACK": "1"}, cpu_amx=True) == "repack=1 args=--port 8080"
    )
