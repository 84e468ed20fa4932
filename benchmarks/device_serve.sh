#!/usr/bin/env bash
# Device measurements of `ktorch serve` (issue 33), from the repo root on the H100 host, limit 360 s of wall clock:
# the 48-layer Qwen3-30B-A3B-shaped Q8_0 GGUF (random weights, no tokenizer: prompts are token ids), experts in host
# memory, served by `ktorch serve` with its defaults, driven over HTTP by benchmarks/bench_serve.py.
#
#   bash benchmarks/device_serve.sh [FILE]   # FILE: /tmp/q8.gguf; needs transformers >= 5.24 (.whl/ installed first)
#
# Stages, most important first; each is cut by `timeout` so the script ends by its limit (a stage that has no time
# left prints SKIPPED):
#   0. the file: /tmp/q8.gguf if present, else written (bench_generate.py --write-layers 48 --write-seed 11, ~95 s);
#      the host's read bandwidth (bench_host_bandwidth.py, CPU row, 16 threads).
#   1. default server (--cuda-graphs auto): aggregate decode tok/s at 1, 16, 64 streams (and each against 1 stream),
#      then TTFT of a 2000-token prompt and of a second one sharing that prefix.
#   2. --step-stats server (eager steps, device synced each step): the same rows with each decode step's time
#      beside its floor (the distinct experts it read, their packed bytes over the measured read bandwidth).
#   3. --cuda-graphs on (transformers captures each padded batch size; the CPU experts run from host functions in
#      the graphs): the same rows; /v1/stats' experts_captured_submits says whether captures happened.
# Prints the tables; logs (server stderr, the load generator's output, /v1/stats) under $OUT.
set -uo pipefail
LIMIT=${LIMIT:-360}
T0=$(date +%s)
OUT=${OUT:-/tmp/device_serve_out}
mkdir -p "$OUT"
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
FILE=${1:-/tmp/q8.gguf}
PORT=8471
left() { echo $((LIMIT - ($(date +%s) - T0) - 8)); }
budget() { local b=$(( $(left) - 25 )); echo $(( b > $1 ? $1 : (b > 5 ? b : 5) )); }  # a load's seconds: 25 s kept to stop its server
say() { echo "[device_serve +$(( $(date +%s) - T0 ))s] $*"; }

python3 - <<'EOF' || { say "transformers < 5.24: ktorch serve cannot run (install the .whl/ wheels)"; exit 1; }
import sys, torch, transformers, aiohttp
from packaging.version import Version
print(f"torch {torch.__version__}, transformers {transformers.__version__}, aiohttp {aiohttp.__version__}, "
      f"GPU {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}")
try:
    import flash_attn  # noqa: F401
    print("flash_attn installed")
except ImportError:
    print("flash_attn not installed: transformers' CB runs sdpa, and its auto setting leaves CUDA graphs off")
sys.exit(Version(transformers.__version__).release < (5, 24))
EOF

if [ ! -f "$FILE" ]; then
  say "writing $FILE (48 layers, Q8_0, seed 11)"
  timeout $(( $(left) - 200 > 60 ? $(left) - 200 : 60 )) \
    python3 benchmarks/bench_generate.py --gguf "$FILE" --write-layers 48 --write-seed 11 --skip-ktorch \
    > "$OUT/write.log" 2>&1 || { say "writing the file failed or ran out of time"; tail -5 "$OUT/write.log"; exit 1; }
fi
ls -l "$FILE"

say "read bandwidth (CPU row, 16 threads)"
timeout 40 python3 benchmarks/bench_host_bandwidth.py --threads 16 --no-gpu --cpu-gib 4 --repeats 2 \
  --json "$OUT/bandwidth.jsonl" > "$OUT/bandwidth.txt" 2>&1
GBS=$(python3 -c "import json; print(round(max(json.loads(l)['cpu_alone'] for l in open('$OUT/bandwidth.jsonl')), 1))" \
  2>/dev/null || echo "")
say "read bandwidth: ${GBS:-not measured} GB/s"

SERVER_PID=
stop_server() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    curl -s "http://127.0.0.1:$PORT/v1/stats" | python3 -c \
      "import json,sys; d=json.load(sys.stdin); d.pop('steps', None); print('  /v1/stats at the end:', d)" || true
    kill -INT "$SERVER_PID"
    for _ in $(seq 40); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$SERVER_PID" 2>/dev/null && { say "the server did not stop in 20 s: killed"; kill -KILL "$SERVER_PID"; }
    wait "$SERVER_PID" 2>/dev/null
  fi
  SERVER_PID=
}
trap stop_server EXIT

# start_server NAME [serve options]: starts it and waits for /health (the model loads in ~30 s)
start_server() {
  local name=$1; shift
  say "stage $name: ktorch serve --model $FILE --port $PORT --kv-cache-gib 16 $*"
  python3 -m ktorch.cli serve --model "$FILE" --port $PORT --kv-cache-gib 16 "$@" > "$OUT/server_$name.log" 2>&1 &
  SERVER_PID=$!
  local deadline=$(( $(date +%s) + 120 ))
  while [ "$(date +%s)" -lt $deadline ] && [ "$(left)" -gt 20 ]; do
    if ! kill -0 $SERVER_PID 2>/dev/null; then say "the server exited:"; tail -20 "$OUT/server_$name.log"; SERVER_PID=; return 1; fi
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && { say "serving"; grep "\[ktorch\]" "$OUT/server_$name.log" | head -3; return 0; }
    sleep 1
  done
  say "the server did not answer /health in time"; tail -5 "$OUT/server_$name.log"; stop_server; return 1
}

# run_load NAME SECONDS [bench_serve options]
run_load() {
  local name=$1 secs=$2; shift 2
  local cmd="python3 benchmarks/bench_serve.py --url http://127.0.0.1:$PORT $*"
  echo "\$ $cmd"
  timeout "$secs" $cmd 2>&1 | tee "$OUT/load_$name.txt"
  grep -E "Traceback|ERROR|rror:" "$OUT/server_$name.log" | head -5
}

# 1. the default server: throughput and the shared-prefix TTFT
if [ "$(left)" -gt 90 ] && start_server default; then
  run_load default $(budget 150) --streams 1 16 64 --prompt-len 32 --max-tokens 48 \
    --ttft-prefix 2000 --ttft-suffix 50
  stop_server
else say "stage default SKIPPED (time left $(left) s)"; fi

# 2. per-step times beside their floor
if [ "$(left)" -gt 80 ] && start_server steps --step-stats; then
  run_load steps $(budget 120) --streams 1 16 64 --prompt-len 32 --max-tokens 32 --steps \
    ${GBS:+--read-gbs $GBS}
  stop_server
else say "stage steps SKIPPED (time left $(left) s)"; fi

# 3. transformers' CUDA graphs forced on
if [ "$(left)" -gt 80 ] && start_server graphs --cuda-graphs on; then
  run_load graphs $(budget 120) --streams 1 16 64 --prompt-len 32 --max-tokens 48
  stop_server
else say "stage graphs SKIPPED (time left $(left) s)"; fi
say "done"
