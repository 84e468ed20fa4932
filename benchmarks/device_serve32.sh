#!/usr/bin/env bash
# Device A/B of session 32's serve step (issue 33: a second request sharing a 2000-token prefix sees its first token
# in <= 15% of the first's TTFT; serve's one-stream decode step against generate's captured one), from the repo root,
# limit 240 s of wall clock (LIMIT=...), transformers >= 5.24 installed (the .whl/ wheels, as device_serve.sh):
#
#   bash benchmarks/device_serve32.sh [FILE]    # FILE: a Qwen3-30B-A3B-shaped Q8_0 GGUF; default /tmp/q8-12l-serve32.gguf,
#                                               # written when absent (12 random layers, ~8 GB, about a minute);
#                                               # the 48-layer /tmp/q8.gguf of device_serve.sh works too (slower)
#
# Two servers in turn, each `ktorch serve` with the defaults (CUDA-graph steps, 16-token pages, no --step-stats),
# experts in host memory (--gpu-memory off), run by benchmarks/bench_serve_timeline.py (timestamps at hand-offs):
#   new  the default: graphed steps captured with the decoder layers compiled regionally, cache reads padded to
#        powers of two from 256 (ktorch/serve/engine.py kv_bucket), steps of up to 16 tokens warmed up at 512..4096
#        reads (the first start compiles the layers, once per token bucket: Inductor's disk cache serves the next)
#   old  session 31's step (benchmark variants, no user switches): --eager-layers --graph-kv-min 4096
# Per server: the time to /health (load + the graphs' warm-up, whose seconds /v1/stats reports), then
# benchmarks/bench_serve.py: 5 TTFT pairs (2000-token shared prefix + 8 new tokens, 8 tokens out; the medians) and
# one-stream decode (32-token prompt, 48 tokens: tok/s, inter-token median), then the timeline client (2 pairs):
# the one-stream decode step's median (compute + wait) and the second request's step. Then, when time is left,
# `ktorch generate` on the same file (--gpu-memory off): its captured decode step for reference.
# Prints one table at the end; logs under $OUT.
set -uo pipefail
LIMIT=${LIMIT:-240}
T0=$(date +%s)
OUT=${OUT:-/tmp/device_serve32_out}
mkdir -p "$OUT"
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
FILE=${1:-/tmp/q8-12l-serve32.gguf}
PORT=8472
left() { echo $((LIMIT - ($(date +%s) - T0) - 5)); }
say() { echo "[device_serve32 +$(( $(date +%s) - T0 ))s] $*"; }

python3 - <<'EOF' || { say "transformers < 5.24: ktorch serve cannot run (install the .whl/ wheels)"; exit 1; }
import sys, torch, transformers
from packaging.version import Version
print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
      f"GPU {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}")
sys.exit(Version(transformers.__version__).release < (5, 24))
EOF
lscpu | grep -E "Model name|^CPU\(s\)" | tr -s ' '

if [ ! -f "$FILE" ]; then
  say "writing $FILE (12 layers, Q8_0, seed 11)"
  timeout $(( $(left) - 130 > 60 ? $(left) - 130 : 60 )) python3 benchmarks/bench_generate.py --gguf "$FILE" \
    --write-layers 12 --write-type Q8_0 --write-seed 11 --skip-ktorch > "$OUT/write.log" 2>&1 \
    || { say "writing the file failed or ran out of time"; tail -5 "$OUT/write.log"; exit 1; }
fi
ls -l "$FILE"

SERVER_PID=
stop_server() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -INT "$SERVER_PID"
    for _ in $(seq 30); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$SERVER_PID" 2>/dev/null && kill -KILL "$SERVER_PID"
    wait "$SERVER_PID" 2>/dev/null
  fi
  SERVER_PID=
}
trap stop_server EXIT

# run_variant NAME [variant options]: one server, its loads, its row's figures in $OUT/row_NAME.txt
run_variant() {
  local name=$1; shift
  if [ "$(left)" -lt 45 ]; then say "variant $name SKIPPED (time left $(left) s)"; echo "SKIPPED" > "$OUT/row_$name.txt"; return; fi
  say "variant $name: bench_serve_timeline.py serve $* --model $FILE --gpu-memory off"
  local t_start=$(date +%s.%N)
  python3 benchmarks/bench_serve_timeline.py serve "$@" --model "$FILE" --port $PORT --kv-cache-gib 16 \
    --gpu-memory off > "$OUT/server_$name.log" 2>&1 &
  SERVER_PID=$!
  local ready=
  while [ "$(left)" -gt 30 ]; do
    if ! kill -0 $SERVER_PID 2>/dev/null; then say "the server exited:"; tail -20 "$OUT/server_$name.log"; break; fi
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && { ready=1; break; }
    sleep 0.5
  done
  if [ -z "$ready" ]; then echo "FAILED: no /health (see $OUT/server_$name.log)" > "$OUT/row_$name.txt"; stop_server; return; fi
  local up=$(python3 -c "import time; print(f'{time.time() - $t_start:.1f}')")
  say "serving after $up s"
  local budget=$(( $(left) - 25 ))
  timeout $(( budget > 60 ? 60 : (budget > 10 ? budget : 10) )) python3 benchmarks/bench_serve.py \
    --url http://127.0.0.1:$PORT --streams 1 --prompt-len 32 --max-tokens 48 --ttft-prefix 2000 --ttft-suffix 8 \
    --ttft-repeat 5 2>&1 | tee "$OUT/load_$name.txt" | grep -E "^ +1 \||median of|rror"
  budget=$(( $(left) - 20 ))
  if [ "$budget" -gt 15 ]; then
    timeout $(( budget > 40 ? 40 : budget )) python3 benchmarks/bench_serve_timeline.py client \
      --url http://127.0.0.1:$PORT --prefix 2000 --suffix 8 --repeat 2 --decode-tokens 48 2>&1 \
      | tee "$OUT/timeline_$name.txt" | grep -E "ratio to|compute |step \(compute"
  fi
  curl -s -m 10 "http://127.0.0.1:$PORT/v1/stats" > "$OUT/stats_$name.json"
  grep -E "Traceback|ERROR|rror:|failed" "$OUT/server_$name.log" | head -5
  stop_server
  python3 - "$name" "$up" "$OUT" <<'EOF' > "$OUT/row_$name.txt"
import json, re, sys
name, up, out = sys.argv[1], float(sys.argv[2]), sys.argv[3]
def read(path):
    try:
        return open(path).read()
    except OSError:
        return ""
load, tl = read(f"{out}/load_{name}.txt"), read(f"{out}/timeline_{name}.txt")
try:
    st = json.loads(read(f"{out}/stats_{name}.json"))
except ValueError:
    st = {}
nan = float("nan")
def num(pattern, text):
    m = re.search(pattern, text)
    return float(m.group(1)) if m else nan
first, second = num(r"median of \d+: first ([\d.]+) ms", load), num(r"second ([\d.]+) ms, ratio", load)
ratio = num(r"ratio ([\d.]+)%", load)
row = next((l.split("|") for l in load.splitlines() if re.match(r"^\s+1 \|", l)), None)
tok_s, itl = (float(row[1]), float(row[4])) if row else (nan, nan)
step = num(r"step \(compute \+ wait\) +([\d.]+)", tl)
second_step = num(r"\n  compute +([\d.]+)", tl) + num(r"\n  wait +([\d.]+)", tl)
print(f"{name:4s} | {up:6.1f} | {st.get('graph_warmup_seconds', nan):7.1f} | {st.get('graph_captures', '-'):>4} "
      f"{st.get('graph_compile_failures', '-'):>3} | "
      f"{first:8.1f} | {second:7.1f} | {ratio:6.1f}% | {second_step:9.2f} | {tok_s:8.1f} | {itl:7.2f} | {step:8.2f}")
EOF
}

run_variant new
run_variant old --eager-layers --graph-kv-min 4096

GEN="not run"
if [ "$(left)" -gt 50 ]; then
  say "reference: ktorch generate --gpu-memory off (32-token prompt, 48 tokens)"
  timeout $(( $(left) - 5 )) python3 benchmarks/bench_generate.py --gguf "$FILE" --prompts 32 --gen 48 --runs 1 \
    --prompt-kind random --ktorch-args "--gpu-memory off" --timeout $(( $(left) - 10 )) > "$OUT/generate.log" 2>&1
  GEN=$(python3 -c "
import json, re
for line in open('$OUT/generate.log'):
    m = re.search(r'\{.*\"decode_tok_s\".*\}', line)
    if m:
        r = json.loads(m.group(0)); print(f\"decode {r['decode_tok_s']:.1f} tok/s: a step {1000 / r['decode_tok_s']:.2f} ms\"); break
else:
    print('no decode rate (see $OUT/generate.log)')
" 2>/dev/null || echo "failed")
fi

echo
echo "================ device_serve32 ($(( $(date +%s) - T0 )) s): $(basename "$FILE"), experts in host memory ================"
echo "TTFT: 2000-token shared prefix + 8 new tokens, medians of 5 pairs (bench_serve.py); second's step: compute + wait"
echo "of the second request's step (timeline, median of 2); decode: one stream, 48 tokens (tok/s, inter-token median),"
echo "and its step (compute + wait, timeline median); up: seconds to /health; warm-up: the graphs' (/v1/stats);"
echo "capt fail: graphs captured, captures whose compiled layers failed (then captured eager; 0 expected)"
echo "var  |  up s  | warm s  | capt fail | first ms | 2nd ms  | ratio   | 2nd step  | tok/s    | ITL ms  | step ms"
for name in new old; do cat "$OUT/row_$name.txt" 2>/dev/null || echo "$name | not run"; done
echo "ktorch generate, same file and placement: $GEN"
say "done; logs in $OUT"
