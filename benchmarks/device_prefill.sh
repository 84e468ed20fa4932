#!/usr/bin/env bash
# Device check of issue 36 (routing-aware prefill split, GPU memory budget), through the user path: fresh
# `ktorch generate` processes (benchmarks/bench_generate.py) beside llama-bench on the same random Qwen3-30B-A3B-shaped
# Q8_0 file, in two routing regimes (near-uniform; skewed: --write-router-skew 1.5) and two scenarios:
#   (a) every expert in host memory:   ktorch --stream-experts auto --gpu-memory off   | llama.cpp -ot exps=CPU
#   (b) a GPU budget:                  ktorch --stream-experts auto --gpu-memory $BUDGET | llama.cpp --n-cpu-moe $NCMOE
# plus, in the uniform regime, the CPU op alone (--stream-experts off) and the old fixed prefix (512:0.45,2048:0.8).
# Prints per run: prefill/decode tok/s, distinct experts hit per layer, experts and GB copied per prompt pass,
# "copied but unused" (must be 0), GPU memory planned vs measured peak, decode resident hit rate.
#
#   bash benchmarks/device_prefill.sh            # from the repo root; ~9-10 minutes wall (give it 600 s)
#
# LAYERS (default 12: ~8.3 GB per file, written in ~1 min each) keeps it inside one device command. The 24 GiB budget of
# the 48-layer model scales to BUDGET=8GiB here with NCMOE=4 (llama.cpp: 8 of 12 layers' experts on the GPU, as 34 of 48
# at 24 GiB); ktorch keeps residents packed (int8, about Q8_0's bytes) as each layer's most routed-to experts.
# llama.cpp: /tmp/lcpp/bin/llama-bench if the lead built it in the same call, else skipped (said below).
# SKEWS="0" or SKEWS="1.5" runs one regime (about half the time each) to split it over two device commands.
set -uo pipefail
LAYERS=${LAYERS:-12}
BUDGET=${BUDGET:-8GiB}
NCMOE=${NCMOE:-4}
OUT=${OUT:-/tmp/device_prefill_out}
mkdir -p "$OUT"
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
LLAMA=/tmp/lcpp/bin/llama-bench
[ -x "$LLAMA" ] || { echo "llama-bench not at $LLAMA: llama.cpp skipped"; LLAMA=""; }
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
lscpu | grep -E "Model name|^CPU\(s\)" | tr -s ' '
python3 -c "import torch, ktorch; print('torch', torch.__version__, 'ktorch', ktorch.__file__, ktorch.cpu_features())" 2>&1 | tail -1

if [ "${TESTS:-1}" = 1 ]; then  # TESTS=0 when the whole suite already ran in this device session
  echo "=== CUDA tests of the change ($(date +%T))"
  timeout 240 python3 -m pytest -q -x tests/test_routed_experts.py tests/test_runtime_staging.py -k "cuda" 2>&1 | tail -4
fi

run() {  # $1 label, then bench_generate arguments
  local label=$1; shift
  echo "=== $label ($(date +%T))"
  timeout 400 python3 benchmarks/bench_generate.py --runs 1 --prompts 512 2048 --gen 64 --prompt-kind random \
    --timeout 200 --json "$OUT/prefill.jsonl" "$@" 2>&1 | tee -a "$OUT/prefill.log" \
    | grep -vE "^\s*\{" | grep -E "===|P=|split:|GPU memory|llama.cpp best|rror|wrote|skipped" || true
}

for SKEW in ${SKEWS:-0 1.5}; do
  FILE=/tmp/q8-${LAYERS}l-skew${SKEW}.gguf
  LB=(); [ -n "$LLAMA" ] && LB=(--llama-bench "$LLAMA" --threads 16 --flash-attn 1 --llama-reps 2 --llama-timeout 120)
  EXTRA=("--stream-experts auto --gpu-memory off")
  [ "$SKEW" = 0 ] && EXTRA+=("--stream-experts off" "--stream-experts 512:0.45,2048:0.8")
  run "skew $SKEW (a) experts in host memory" --gguf "$FILE" --write-layers "$LAYERS" --write-type Q8_0 \
    --write-router-skew "$SKEW" --ktorch-args "${EXTRA[@]}" "${LB[@]}"
  run "skew $SKEW (b) GPU budget $BUDGET / --n-cpu-moe $NCMOE" --gguf "$FILE" \
    --ktorch-args "--stream-experts auto --gpu-memory $BUDGET" "--gpu-memory auto" "${LB[@]}" --llama-n-cpu-moe "$NCMOE"
  rm -f "$FILE"
done
echo "done $(date +%T); full log $OUT/prefill.log, rows $OUT/prefill.jsonl"
