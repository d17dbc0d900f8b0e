#!/usr/bin/env bash
# What llama.cpp's weight repacking is worth on this CPU: the cache's llama-server with
# repacking on (the default), then with LLAMA_ARG_REPACK=0 (what a binary with AMX kernels
# gets on an AMX CPU, docs/backends.md "CPUs with AMX"), alternated ROUNDS times so that
# both see the same machine, for the chat stand-in (Q4_1), the same requantized to Q4_0
# (a type x86 repacks; llama-quantize is built from the cached source for it, once) and
# the MiniLM embedding model (F16).
#
# Usage: scripts/bench_repack.sh [ROUNDS] [OUT]     (after `make test-assets`)
# Prints one `rerank-server bench --scenarios model` line per run; OUT keeps bench.json.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
out=${2:-bench-results/repack}
cache=${RERANK_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/rerank-server}
binary=$(ls "$cache"/llama.cpp/*-no-amx/llama-server | head -n 1)
port=18181

serve() {  # MODEL REPACK ARGS...: a llama-server in the background, ready
  local model=$1 repack=$2; shift 2
  if [ "$repack" = off ]; then export LLAMA_ARG_REPACK=0; else unset LLAMA_ARG_REPACK; fi
  "$binary" -m "$model" --host 127.0.0.1 --port $port --no-webui --cache-ram 0 "$@" \
    >"$out/llama-server.log" 2>&1 &
  pid=$!
  unset LLAMA_ARG_REPACK
  until curl -fsS -o /dev/null "http://127.0.0.1:$port/health" 2>/dev/null; do
    kill -0 $pid || { tail "$out/llama-server.log"; exit 1; }
    sleep 0.5
  done
}

bench() {  # KIND NAME: one model-scenario run against the llama-server on $port
  .venv/bin/rerank-server bench --scenarios model --backend-url "http://127.0.0.1:$port" \
    --slots 4 --backend "$1" --rounds 3 --out "$out/$2-$repack-$round" \
    | grep -E "^\`$1\`" | sed "s/^/round $round, $2, repack $repack: /"
  kill $pid; wait $pid || true
}

mkdir -p "$out"
q4_0="$cache/models/SmolLM2-135M-Instruct.Q4_0-requantized.gguf"
if [ ! -f "$q4_0" ]; then
  build=$(ls -d "$cache"/build/*/cmake-build | head -n 1)
  cmake --build "$build" --target llama-quantize -j 2 >/dev/null
  "$build/bin/llama-quantize" --allow-requantize \
    "$cache/models/SmolLM2-135M-Instruct.Q4_1.gguf" "$q4_0.partial" Q4_0 >/dev/null 2>&1
  mv "$q4_0.partial" "$q4_0"
fi
for round in $(seq "$rounds"); do
  for repack in on off; do
    serve "$cache/models/SmolLM2-135M-Instruct.Q4_1.gguf" $repack -np 4 -c 8192
    bench chat chat-q4_1
    serve "$q4_0" $repack -np 4 -c 8192
    bench chat chat-q4_0
    serve "$cache/models/all-MiniLM-L6-v2.f16.gguf" $repack --embedding --pooling mean \
      -np 4 -c 2048 -b 2048 -ub 512
    bench embedding embedding-f16
  done
done
