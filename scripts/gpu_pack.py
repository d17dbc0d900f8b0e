"""Pack what a GPU session carries to the `device` machine, in three loads of under 64 MiB.

Usage: python scripts/gpu_pack.py      (after `make test-assets`; needs PyPI for the wheels)

A session lent a GPU has 15 minutes of device time, and each call carries at most 64 MiB
(the repository included). Everything is prepared here, checked, and sized, so that
there is nothing to find out there:

- `.gpu/a`: the pinned llama.cpp source without its docs, tests, vocabularies and
  examples (xz, about 8 MB; the managed build here uses the whole sdist) with the managed
  build's CMake flags, and the first half of the stand-in chat model (SmolLM2-135M Q4_1,
  98 MB: no call carries it whole).
- `.gpu/b`: the model's second half with its sha256, and cp312 wheels of the Python
  packages the device image lacks or holds in other versions, at the versions installed
  here (the versions the tests ran with).
- `.gpu/d`: what `build` and `rerank` need, for one call that does both (links to
  the files above).
- `.gpu/c`: MiniLM-L6 for the `embedding` backend and the same with its one-logit rank
  head for the `rerank` backend (`llama-server --rerank`), both quantized to Q8_0 (25 MB
  each; the two f16 files would not fit one call) with `llama-quantize` of the pinned
  source, built here into the managed build's folder (a minute, once).

`.gpu/` is ignored by git. `scripts/gpu_run.sh` runs the steps there; docs/benchmarks.md
("On a GPU: through rerank-server against direct") gives the three calls.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
from importlib.metadata import version
from pathlib import Path

from rerank_server.managed import converted, downloads, llama_build
from rerank_server.settings import default_cache_dir

ROOT = Path(__file__).resolve().parent.parent
PACK = ROOT / ".gpu"
LIMIT = 64 * 2**20  # bytes a call carries, the repository included
# Not needed to configure and build llama-server (LLAMA_BUILD_TESTS and _EXAMPLES off).
SOURCE_LEFT_OUT = (
    "models",
    "docs",
    "media",
    "benches",
    "tests",
    "pocs",
    "skills",
    "gguf-py",
    "conversion",
    "examples",
    ".git",
)
# The device image (KINDS.md) has numpy, httpx, httpcore, anyio, h11, click, uvloop,
# annotated-doc, matplotlib and tqdm; these it lacks, or its versions differ from ours
# (the generated gRPC code wants its grpcio and protobuf at least as new as ours).
WHEELS = (
    "grpcio",
    "grpcio-health-checking",
    "grpcio-reflection",
    "protobuf",
    "sniffio",
    "orjson",
    "msgspec",
    "pybase64",
    "opentelemetry-api",
    "opentelemetry-sdk",
    "opentelemetry-semantic-conventions",
    "opentelemetry-exporter-prometheus",
    "opentelemetry-exporter-otlp-proto-grpc",
    "opentelemetry-exporter-otlp-proto-common",
    "opentelemetry-exporter-otlp-common",
    "opentelemetry-proto",
    "googleapis-common-protos",
    "structlog",
    "fastapi",
    "starlette",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "uvicorn",
    "typing-extensions",
    "prometheus-client",
)
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)


def pack_source(cache: Path, target: Path) -> None:
    source = llama_build.llama_source(cache)

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        parts = Path(info.name).parts
        return None if len(parts) > 1 and parts[1] in SOURCE_LEFT_OUT else info

    print(f"packing {source} without {', '.join(SOURCE_LEFT_OUT)}", flush=True)
    with tarfile.open(target, "w:xz") as tar:
        tar.add(source, arcname="llama.cpp", filter=keep)
    # The managed build's own CMake flags, so the two builds cannot drift apart.
    target.with_name("cmake-flags.txt").write_text("\n".join(llama_build.CMAKE_FLAGS) + "\n")


def split_model(model: Path, first: Path, second: Path) -> None:
    data = model.read_bytes()
    half = len(data) // 2
    first.write_bytes(data[:half])
    second.write_bytes(data[half:])
    digest = hashlib.sha256(data).hexdigest()
    second.with_name("smollm2.sha256").write_text(f"{digest}  smollm2.gguf\n")


def quantize(cache: Path, model: Path, target: Path) -> None:
    """`model` as Q8_0 at `target`, by the pinned llama.cpp's `llama-quantize`."""
    build = llama_build.llama_source(cache).parent / "cmake-build"  # the managed build's
    tool = build / "bin" / "llama-quantize"
    if not tool.exists():
        print("building llama-quantize", flush=True)
        subprocess.run(
            [
                "cmake",
                "--build",
                str(build),
                "--target",
                "llama-quantize",
                "-j",
                str(os.cpu_count() or 2),
            ],
            check=True,
            capture_output=True,
        )
    subprocess.run([str(tool), str(model), str(target), "q8_0"], check=True, capture_output=True)


def download_wheels(target: Path) -> None:
    pins = [f"{name}=={version(name)}" for name in WHEELS]
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            "3.12",
            "--implementation",
            "cp",
            *platforms,
            "-d",
            str(target),
            *pins,
        ],
        check=True,
    )


def tree_bytes() -> int:
    """What travels besides the carried paths: tracked and untracked-not-ignored files."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    return sum(
        (ROOT / os.fsdecode(p)).stat().st_size
        for p in listed
        if p and (ROOT / os.fsdecode(p)).is_file()
    )


def main() -> int:
    cache = Path(os.environ.get("RERANK_CACHE_DIR") or default_cache_dir())
    minilm = converted.embedding_model_path(cache)
    rank_head = converted.rank_head_model_path(cache)
    for model in (minilm, rank_head):
        if not model.exists():
            print(f"{model} is missing: run `make test-assets` first", file=sys.stderr)
            return 1
    shutil.rmtree(PACK, ignore_errors=True)
    loads = {name: PACK / name for name in ("a", "b", "c", "d")}
    for folder in loads.values():
        folder.mkdir(parents=True)
    pack_source(cache, loads["a"] / "llama-src.tar.xz")
    split_model(
        downloads.prepare_model(cache), loads["a"] / "smollm2.part1", loads["b"] / "smollm2.part2"
    )
    download_wheels(loads["b"] / "whl")
    quantize(cache, minilm, loads["c"] / "minilm.gguf")
    quantize(cache, rank_head, loads["c"] / "minilm-rank.gguf")
    # `build` and `rerank` in one call, for a session with too little time for three.
    for name in ("a/llama-src.tar.xz", "a/cmake-flags.txt", "c/minilm-rank.gguf"):
        os.link(PACK / name, loads["d"] / Path(name).name)
    shutil.copytree(loads["b"] / "whl", loads["d"] / "whl", copy_function=os.link)
    tree = tree_bytes()
    too_big = False
    for name, folder in loads.items():
        size = tree + sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        too_big |= size > LIMIT
        print(
            f".gpu/{name}: {size / 2**20:.1f} MiB with the repository "
            f"({'over' if size > LIMIT else 'under'} the 64 MiB a call carries)"
        )
    return 1 if too_big else 0


if __name__ == "__main__":
    sys.exit(main())
