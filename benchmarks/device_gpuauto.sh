#!/usr/bin/env bash
# Device check of `--gpu-memory auto` as the default (issues 31, 36), from the repo root on the GPU host, limit 150 s
# of wall clock (needs transformers >= 5.24: the lead's .whl/ first). Runs the CUDA tests of what the change touched
# and prints pytest's summary of each stage; logs under $OUT:
#   1. tests/test_serve_cuda.py (limit 75 s): graphed serve steps equal eager ones with every expert on the CPU op
#      (--gpu-memory off) and with the default residents (no CPU experts call, /v1/stats hit rate 1.0); `ktorch serve`
#      reserves its KV pool before the residents (--kv-pages 512: the plan's reserve is the pool's bytes, the engine
#      allocates it with max_memory_percent 1.0 and serves; default: the pool grown by what the residents leave).
#   2. tests/test_routed_experts.py -k cuda (limit 45 s): prepare/ktorch.load default to residents on a GPU (logits
#      match HF eager, decode hits residents only), "off" holds none, trainable takes them back; the split and the
#      budget's CUDA tests as before.
#   3. tests/test_resident_rows.py -k every_expert_resident (limit 25 s): all residents vs the same int4 experts on
#      the CPU op (the reference now asks for --gpu-memory off explicitly).
# Prints "STAGE name: <pytest summary line>" per stage (or TIMEOUT), then the GPU.
set -uo pipefail
LIMIT=${LIMIT:-150}
T0=$(date +%s)
OUT=${OUT:-/tmp/device_gpuauto_out}
mkdir -p "$OUT"
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader | tee "$OUT/gpu.txt"

stage() {  # stage NAME LIMIT_S pytest-args...
  local name=$1 limit=$2
  shift 2
  local left=$((LIMIT - ($(date +%s) - T0) - 3))
  if ((left < 10)); then echo "STAGE $name: SKIPPED (no time left)"; return; fi
  ((limit > left)) && limit=$left
  timeout "$limit" python -m pytest -q -p no:cacheprovider "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  if ((rc == 124)); then
    echo "STAGE $name: TIMEOUT after ${limit} s; last lines:"; tail -5 "$OUT/$name.log"
  else
    echo "STAGE $name (rc $rc): $(tail -1 "$OUT/$name.log")"
    ((rc != 0)) && grep -E "^(FAILED|ERROR)|Error" "$OUT/$name.log" | head -20
  fi
}

stage serve_cuda 75 tests/test_serve_cuda.py -x
stage routed_cuda 45 tests/test_routed_experts.py -k cuda
stage resident_rows 25 tests/test_resident_rows.py -k every_expert_resident
echo "total $(($(date +%s) - T0)) s"
