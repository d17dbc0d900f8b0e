#!/usr/bin/env bash
# The Qwen3-Reranker-0.6B speed twin (`rerank-server prepare --speed-twin q8_0`) through
# each path rerank-server can score it by, direct and through, on llama-server settings
# given one per line on stdin: "NAME PATH LLAMA-ARGS...", PATH one of chat, completion,
# rerank (the rank head under --rerank). For each: a fresh llama-server, then
# `rerank-server bench --scenarios model` (median of ROUNDS, PASSAGES passages;
# rerank-server's --concurrency is the -np, its --max-batch 32), and the same weights and
# tokens in eager PyTorch beside it when a Python with torch is at hand (`bench` says).
#
# Usage: [EAGER=0] scripts/bench_twin.sh [ROUNDS] [PASSAGES] [OUT] < settings
#   e.g. echo "np4 chat -np 4 -c 8192" | scripts/bench_twin.sh 2 40
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-2}
count=${2:-40}
out=${3:-bench-results/twin}
cache=${RERANK_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/rerank-server}
binary=$(ls "$cache"/llama.cpp/*-no-amx/llama-server | head -n 1)
port=18191
eager=""
[ "${EAGER:-1}" = 0 ] && eager=--no-eager  # EAGER=0: without the physical limit
mkdir -p "$out"
pid=""
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; true' EXIT  # no llama-server outlives us

twin() {  # the twin's file for a head, named where `prepare` names it
  .venv/bin/python -c "import sys; from pathlib import Path
from rerank_server.managed.converted import speed_twin_path
print(speed_twin_path(Path(sys.argv[1]), sys.argv[2], 'q8_0'))" "$cache" "$1"
}

while read -r name path llama; do
  [ -z "$name" ] && continue
  model=$(twin lm)
  slots=$(echo "$llama" | sed -n 's/.*-np \([0-9]*\).*/\1/p')
  if [ "$path" = rerank ]; then
    model=$(twin rank)
    llama="$llama --rerank"
  fi
  # shellcheck disable=SC2086  # the settings are words
  "$binary" -m "$model" --host 127.0.0.1 --port $port --no-webui --cache-ram 0 $llama \
    >"$out/$name.llama.log" 2>&1 &
  pid=$!
  until curl -fsS -o /dev/null "http://127.0.0.1:$port/health" 2>/dev/null; do
    kill -0 $pid || { tail "$out/$name.llama.log"; exit 1; }
    sleep 0.5
  done
  .venv/bin/rerank-server bench --scenarios model --backend-url "http://127.0.0.1:$port" \
    --slots "${slots:-4}" --backend "$path" --rounds "$rounds" --passages "$count" \
    $eager --eager-model "$model" --out "$out/$name" | grep -E "^(\`$path\`|Physical|\*\*Not comparable)" \
    | sed "s/^/$name: /"
  kill "$pid" 2>/dev/null || true
  wait "$pid" || true
  pid=""
done
