#!/usr/bin/env bash
# Device measurements of `ktorch serve` (issue 33), from the repo root on the H100 host, limit 360 s of wall clock:
# the 48-layer Qwen3-30B-A3B-shaped Q8_0 GGUF (random weights, no tokenizer: prompts are token ids), experts in host
# memory (`--gpu-memory off`; GPU_MEMORY=auto measures the default), served by `ktorch serve`, driven over HTTP by
# benchmarks/bench_serve.py.
#
#   bash benchmarks/device_serve.sh [FILE [STAGES]]   # FILE: /tmp/q8.gguf; needs transformers >= 5.24 (.whl/ first)
#
# STAGES (default "tests graphs plain coarse eager"): the stages to run, in this order; "ttft" and "timeline" are
# only run when named (benchmarks/device_serve_ttft.sh names them):
#   ttft      the defaults, no --step-stats: the shared-prefix TTFT (2000 + 8 new tokens), 5 pairs and their
#             medians, and one-stream decode
#   timeline  the defaults under benchmarks/bench_serve_timeline.py (timestamps at each hand-off, no device sync
#             added): the second request's TTFT by phase (HTTP, parsing, submission, scheduling, inputs, the step,
#             the output's way back, the write, the client) and the time outside the step; a decode step's phases
#   ttft12    ttft with KT_NUM_THREADS=12 (one pool thread fewer than a GPU placement's default on 16 cores)
#
# Stages, most important first; each is cut by `timeout` so the script ends by its limit (a stage that has no time
# left prints SKIPPED), and a summary of every stage is printed at the end whatever failed:
#   0. the file: /tmp/q8.gguf if present, else written (bench_generate.py --write-layers 48 --write-seed 11, ~95 s);
#      the host's read bandwidth (bench_host_bandwidth.py, CPU row, 16 threads); the GPU tests
#      (tests/test_serve_cuda.py, built-in model: graphed tokens equal eager ones, a replay per decode step, a
#      prefix hit computes only its suffix; limit 120 s).
#   1. graphs (--cuda-graphs on, as the default auto on a GPU) with --step-stats: decode tok/s at 1, 16, 64 streams, graph replays per step
#      (1.00: every step replayed a graph, 0: eager), each decode step's median time beside its floor (the distinct
#      experts it read, their packed bytes over the measured read bandwidth); then the shared-prefix TTFT (2000-token
#      prefix + 50 new tokens, and + 8) with the prefill steps of both requests beside their floors.
#   2. graphs, no --step-stats (no device sync or expert counting around the steps): decode tok/s and the TTFT.
#   3. stage 2 again with --page-size 64 (the GPU default before 16: whether small pages cost
#      decode throughput).
#   4. when time is left: --cuda-graphs off --step-stats (every step eager): the same decode rows, to compare.
# Prints the tables; logs (server stderr, the load generator's output, /v1/stats) under $OUT.
set -uo pipefail
LIMIT=${LIMIT:-360}
GPU_MEMORY=${GPU_MEMORY:-off}  # issue 33's scenario: every expert in host memory (GPU_MEMORY=auto: the default's)
T0=$(date +%s)
OUT=${OUT:-/tmp/device_serve_out}
mkdir -p "$OUT"
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
FILE=${1:-/tmp/q8.gguf}
STAGES=" ${2:-tests graphs plain coarse eager} "
wants() { [[ "$STAGES" == *" $1 "* ]]; }
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
  RESERVE=$(wants graphs && echo 200 || echo 110)  # what the stages after the file need at least
  timeout $(( $(left) - RESERVE > 60 ? $(left) - RESERVE : 60 )) \
    python3 benchmarks/bench_generate.py --gguf "$FILE" --write-layers 48 --write-seed 11 --skip-ktorch \
    > "$OUT/write.log" 2>&1 || { say "writing the file failed or ran out of time"; tail -5 "$OUT/write.log"; exit 1; }
fi
ls -l "$FILE"

GBS=
if wants graphs || wants eager; then  # the floor of the --step-stats stages
  say "read bandwidth (CPU row, 16 threads)"
  timeout 40 python3 benchmarks/bench_host_bandwidth.py --threads 16 --no-gpu --cpu-gib 4 --repeats 2 \
    --json "$OUT/bandwidth.jsonl" > "$OUT/bandwidth.txt" 2>&1
  GBS=$(python3 -c "import json; print(round(max(json.loads(l)['cpu_alone'] for l in open('$OUT/bandwidth.jsonl')), 1))" \
    2>/dev/null || echo "")
  say "read bandwidth: ${GBS:-not measured} GB/s"
fi

SERVER_PID=
STAGE=
stop_server() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    curl -s -m 10 "http://127.0.0.1:$PORT/v1/stats" | python3 -c \
      "import json,sys; d=json.load(sys.stdin); d.pop('steps', None); print('  /v1/stats at the end:', d)" \
      | tee "$OUT/stats_$STAGE.txt" || true
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
  STAGE=$name
  say "stage $name: ktorch serve --model $FILE --port $PORT --kv-cache-gib 16 --gpu-memory $GPU_MEMORY $* ${SERVE_WITH:+(under $SERVE_WITH)}"
  python3 ${SERVE_WITH:--m ktorch.cli} serve --model "$FILE" --port $PORT --kv-cache-gib 16 --gpu-memory "$GPU_MEMORY" "$@" \
    > "$OUT/server_$name.log" 2>&1 &
  SERVER_PID=$!
  local deadline=$(( $(date +%s) + 120 ))
  while [ "$(date +%s)" -lt $deadline ] && [ "$(left)" -gt 20 ]; do
    if ! kill -0 $SERVER_PID 2>/dev/null; then say "the server exited:"; tail -20 "$OUT/server_$name.log"; SERVER_PID=; return 1; fi
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && { say "serving"; grep "\[ktorch\]" "$OUT/server_$name.log" | head -3; return 0; }
    sleep 1
  done
  say "the server did not answer /health in time"; tail -5 "$OUT/server_$name.log"; stop_server; return 1
}

# run_load NAME SECONDS [bench_serve options] (LOAD_WITH: another load generator taking --url)
run_load() {
  local name=$1 secs=$2; shift 2
  local cmd="python3 ${LOAD_WITH:-benchmarks/bench_serve.py} --url http://127.0.0.1:$PORT $*"
  echo "\$ $cmd"
  timeout "$secs" $cmd 2>&1 | tee "$OUT/load_$name.txt"
  grep -E "Traceback|ERROR|rror:" "$OUT/server_$name.log" | head -5
}

# the GPU tests: replayed steps' tokens equal eager ones, one replay a decode step, a prefix hit computes its suffix
TESTS_RC="not run"
run_tests() {
  say "GPU tests: tests/test_serve_cuda.py"
  timeout $(( $(left) < 120 ? $(left) : 120 )) python3 -m pytest -q -rs tests/test_serve_cuda.py > "$OUT/tests_cuda.txt" 2>&1
  TESTS_RC=$?
  tail -3 "$OUT/tests_cuda.txt"
}
wants tests && [[ "$STAGES" != *" ttft "* ]] && run_tests  # first, unless the TTFT stages come first
STATUS_graphs="not run"; STATUS_eager="not run"; STATUS_plain="not run"; STATUS_coarse="not run"
STATUS_ttft="not run"; STATUS_timeline="not run"; STATUS_ttft12="not run"
# run_stage NAME MIN_LEFT LOAD_SECONDS "serve options" bench_serve options...
run_stage() {
  local name=$1 need=$2 secs=$3 opts=$4; shift 4
  wants "$name" || return
  if [ "$(left)" -le "$need" ]; then eval "STATUS_$name=\"SKIPPED (time left $(left) s)\""; say "stage $name SKIPPED"; return; fi
  # shellcheck disable=SC2086
  if ! start_server "$name" $opts; then eval "STATUS_$name=\"FAILED: the server did not start (see $OUT/server_$name.log)\""; return; fi
  run_load "$name" "$(budget "$secs")" "$@"
  stop_server
  if grep -qE "decode throughput|TTFT, |TTFT \(" "$OUT/load_$name.txt" 2>/dev/null; then eval "STATUS_$name=ran"
  else eval "STATUS_$name=\"FAILED: no measurements (see $OUT/load_$name.txt and $OUT/server_$name.log)\""; fi
}

run_stage ttft 60 60 "" --streams 1 --prompt-len 32 --max-tokens 48 --ttft-prefix 2000 --ttft-suffix 8 --ttft-repeat 5
SERVE_WITH=benchmarks/bench_serve_timeline.py LOAD_WITH="benchmarks/bench_serve_timeline.py client" \
  run_stage timeline 60 60 "" --prefix 2000 --suffix 8 --repeat 5
wants tests && [[ "$STAGES" == *" ttft "* ]] && run_tests
# the ttft stage with one pool thread fewer (KT_NUM_THREADS=12 against the 13 a GPU placement leaves on 16 cores):
# whether the server's HTTP loop and the client, beside 13 spinning workers, the host-task worker and CUDA's
# callback thread, wait for a core
KT_NUM_THREADS=12 run_stage ttft12 60 60 "" --streams 1 --prompt-len 32 --max-tokens 48 --ttft-prefix 2000 \
  --ttft-suffix 8 --ttft-repeat 5
run_stage graphs 100 150 "--cuda-graphs on --step-stats" --streams 1 16 64 --prompt-len 32 --max-tokens 40 --steps ${GBS:+--read-gbs $GBS} \
  --ttft-prefix 2000 --ttft-suffix 50 8
run_stage plain 80 90 "" --streams 1 16 64 --prompt-len 32 --max-tokens 48 --ttft-prefix 2000 --ttft-suffix 50 8
# the prefix granularity: 16-token pages (the default) cache all but the last partial page of a prompt; 64 before
run_stage coarse 60 90 "--page-size 64" --streams 1 16 64 --prompt-len 32 --max-tokens 48 --ttft-prefix 2000 --ttft-suffix 50 8

run_stage eager 90 110 "--cuda-graphs off --step-stats" --streams 1 16 64 --prompt-len 32 --max-tokens 32 --steps \
  ${GBS:+--read-gbs $GBS}

echo
echo "================ summary (device_serve.sh, $(( $(date +%s) - T0 )) s, read bandwidth ${GBS:-not measured} GB/s) ================"
echo "--- GPU tests (tests/test_serve_cuda.py, rc $TESTS_RC): $(tail -1 "$OUT/tests_cuda.txt" 2>/dev/null)"
[ "$TESTS_RC" = 0 ] || [ "$TESTS_RC" = "not run" ] || grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/tests_cuda.txt" | head -8 | sed 's/^/    /'
for name in ttft timeline ttft12 graphs eager plain coarse; do
  eval "st=\$STATUS_$name"
  echo "--- stage $name: $st"
  f="$OUT/load_$name.txt"
  [ -f "$f" ] || continue
  grep -E "^ +(1|16|64) \|" "$f" | sed 's/^/    /'
  grep -E "steps of [0-9]+ tokens" "$f" | sed 's/^ */    /'
  if [ "$name" = timeline ]; then sed -n '/^second request/,$p' "$f" | sed 's/^/    /'
  else grep -E "TTFT, |first request|second, same prefix|prefill step|outside them|median of|a step every" "$f" | sed 's/^ */    /'; fi
  grep -h "graph_warmup_seconds" "$OUT/stats_$name.txt" 2>/dev/null | python3 -c "
import ast, sys
for line in sys.stdin:
    d = ast.literal_eval(line.split(':', 1)[1].strip())
    print('    server at the end: cuda_graphs', d.get('cuda_graphs'), '| graph replays', d.get('graph_replays'),
          'of', d.get('forwards'), 'steps | captures', d.get('graph_captures'), '| warm-up', d.get('graph_warmup_seconds'),
          's | experts captured submits', d.get('experts_captured_submits'))
" 2>/dev/null
done
say "done"
