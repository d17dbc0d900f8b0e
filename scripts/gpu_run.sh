#!/usr/bin/env bash
# One step of the GPU measurement, on the `device` machine (docs/benchmarks.md, "On a
# GPU: through rerank-server against direct"); `scripts/gpu_pack.py` prepared what the
# calls carry.
#
#   bash scripts/gpu_run.sh build       carry .gpu/a: CUDA build of the pinned llama-server
#   bash scripts/gpu_run.sh chat        carry .gpu/b: SmolLM2 chat, direct and through
#   bash scripts/gpu_run.sh embedding   carry .gpu/c: MiniLM embeddings, then MiniLM with a
#                                       rank head (`rerank`), each direct and through
#   bash scripts/gpu_run.sh rerank      the rank head alone
#   bash scripts/gpu_run.sh overhead    after chat (its wheels): what rerank-server adds
#                                       against an instant fake backend, on these cores
# .gpu/d holds what `build` and `rerank` need, for one call that does both:
#   PACK_A=.gpu/d PACK_B=.gpu/d PACK_C=.gpu/d bash -c 'scripts/gpu_run.sh build && scripts/gpu_run.sh rerank'
#
# The steps share .gpu/work (never carried, so kept while the machine stays warm: issue
# the calls back to back). Results go to $OUT/<step>/ (bench.json, bench.md) with logs.
# Here, for a dry run on the CPU: GPU=0 PYTHON=.venv/bin/python SITE=0 bash scripts/gpu_run.sh STEP
set -euo pipefail
export PYTHONUNBUFFERED=1
step=${1:?build, chat, embedding, rerank or overhead}
OUT=${OUT:-/tmp/gpu-out}
PY=${PYTHON:-python3}
GPU=${GPU:-1}
W=.gpu/work
A=${PACK_A:-.gpu/a} B=${PACK_B:-.gpu/b} C=${PACK_C:-.gpu/c}  # what the calls carry
PORT=18080
mkdir -p "$W" "$OUT/$step"

python_path() {
  if [ "${SITE:-1}" = 1 ] && [ ! -e "$W/site/.done" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$W/site" "$B"/whl/*.whl
    touch "$W/site/.done"
  fi
  export PYTHONPATH="$PWD/$W/site:$PWD:$PWD/clients/python"
}

serve() {  # MODEL ARGS...: llama-server on $PORT, waited for
  local model=$1; shift
  # --cache-ram 0 as managed mode runs it (docs/backends.md, "llama-server's prompt cache
  # in memory"); CACHE_RAM=8192 gives llama-server's own default, for comparison.
  "$W/build/bin/llama-server" -m "$model" --host 127.0.0.1 --port "$PORT" -ngl 99 \
    --cache-ram "${CACHE_RAM:-0}" "$@" \
    > "$OUT/${LOG_DIR:-$step}/llama-server.log" 2>&1 &
  LLAMA=$!
  trap 'kill $LLAMA 2>/dev/null || true' EXIT
  "$PY" - "$PORT" <<'EOF'
import sys, time, urllib.request
for _ in range(240):
    try:
        if urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=1).status == 200:
            sys.exit(0)
    except OSError:
        pass
    time.sleep(0.5)
sys.exit("llama-server did not answer /health within 120 s")
EOF
}

bench() {  # KIND SCENARIOS [DIR]: the issue's table, one 40-candidate request and 1/4/16 clients
  # ROUNDS, CLIENTS, SECONDS_PER_LEVEL and PASSAGES shorten a dry run on the CPU.
  "$PY" -m rerank_server bench --scenarios "$2" --backend-url "http://127.0.0.1:$PORT" \
    --backend "$1" --slots 32 --passages "${PASSAGES:-40}" --rounds "${ROUNDS:-5}" \
    --clients "${CLIENTS-1,4,16}" --seconds "${SECONDS_PER_LEVEL:-5}" --out "$OUT/${3:-$step}"
}

case $step in
  build)
    (nvidia-smi || true) > "$OUT/$step/nvidia-smi.txt" 2>&1
    nproc > "$OUT/$step/cores.txt"
    # Unpacked once: a build call that ran out of time is run again and resumes.
    if [ ! -e "$W/src/llama.cpp/CMakeLists.txt" ]; then
      rm -rf "$W/src" && mkdir -p "$W/src" && tar -xJf "$A/llama-src.tar.xz" -C "$W/src"
    fi
    cuda=()
    # H100 and H200 are sm_90: one architecture builds in a fraction of the time of all.
    # FlashAttention's kernels are about half of what nvcc compiles; without them (FA=OFF,
    # the default here) the build fits the device time a session has. Both sides of every
    # comparison use the same server, so the ratios hold; the absolute figures are those of
    # a build without FlashAttention. NCCL is for several GPUs.
    [ "$GPU" = 1 ] && cuda=(-DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90}"
                           "-DGGML_CUDA_FA=${FA:-OFF}" -DGGML_CUDA_NCCL=OFF)
    command -v nvcc > /dev/null || export PATH="$PATH:/usr/local/cuda/bin"
    generator=()
    command -v ninja > /dev/null && [ ! -e "$W/build/Makefile" ] && generator=(-G Ninja)
    mapfile -t flags < "$A/cmake-flags.txt"  # the managed build's (assets.CMAKE_FLAGS)
    start=$(date +%s)
    cmake -S "$W/src/llama.cpp" -B "$W/build" "${generator[@]}" "${flags[@]}" -DGGML_NATIVE=OFF "${cuda[@]}" \
      > "$OUT/$step/cmake.log" 2>&1
    cmake --build "$W/build" --target llama-server -j "$(nproc)" >> "$OUT/$step/cmake.log" 2>&1
    echo "built in $(( $(date +%s) - start )) s"
    "$W/build/bin/llama-server" --version 2>&1 | tee "$OUT/$step/version.txt"
    if [ -e "$A/smollm2.part1" ]; then cp "$A/smollm2.part1" "$W/"; fi  # the next call: the rest
    ;;
  chat)
    python_path
    cat "$W/smollm2.part1" "$B/smollm2.part2" > "$W/smollm2.gguf"
    sum=$(realpath "$B/smollm2.sha256")
    (cd "$W" && sha256sum -c "$sum")
    serve "$W/smollm2.gguf" -np 32 -c 65536
    # The table (model), chat against completion through rerank-server (backends), and
    # /completion's own options straight to llama-server (completion-options).
    bench chat model,backends,completion-options
    ;;
  embedding|rerank)
    python_path
    if [ "$step" = embedding ]; then
      serve "$C/minilm.gguf" --embedding --pooling mean -np 32 -c 16384 -b 512 -ub 512
      bench embedding model
      kill "$LLAMA" 2>/dev/null || true; wait "$LLAMA" 2>/dev/null || true
    fi
    # The same MiniLM with a one-logit rank head: llama-server's /v1/rerank.
    mkdir -p "$OUT/rerank" && LOG_DIR=rerank
    serve "$C/minilm-rank.gguf" --rerank -np 32 -c 16384 -b 512 -ub 512
    bench rerank model rerank
    ;;
  overhead)
    # Issue 17's CPU and added-latency targets, on the GPU machine's cores: no GPU work.
    python_path
    "$PY" -m rerank_server bench --scenarios overhead --requests "${REQUESTS:-100}" \
      --out "$OUT/$step"
    ;;
  *)
    echo "unknown step $step: build, chat, embedding, rerank or overhead" >&2
    exit 2
    ;;
esac
