#!/usr/bin/env bash
# Device check of issue 35's delta forward on the packed kernels (kt.fused_moe_delta for bf16 hidden runs
# kt.fused_moe's path; fused_moe_backward.cpp's opening comment), in one call of at most 240 s:
#   1. correctness at every kernel level the host has (portable, avx512, amx: the suite's `kernel` fixture): the delta
#      forward against the float64 reference with the deltas for every task plan, activation, bias, gateless experts,
#      delta dtype and fp16 hidden, its pre-activations output (gate_up) too; zero deltas equal to kt.fused_moe bit
#      for bit; its bf16 autograd; the backward reading the saved pre-activations against the reference and the
#      recompute (test_saved_*); the backward's decode and the fewer-experts-than-threads mode. Prints pytest's summary
#      (passed/failed/skipped per level).
#   2. one Qwen3-30B-A3B layer (E=128, H=2048, I=768, K=8, int8, T=2048, random weights): ms a call of kt.fused_moe,
#      kt.fused_moe_delta, kt.fused_moe_backward (with deltas and grad_h, reading the forward's saved
#      pre-activations: what expert LoRA's autograd runs), the plain backward, and the expert-LoRA backward
#      recomputing the pre-activations (fused_moe_backward_recompute: the path before they were saved) side by side
#      with their ratios to kt.fused_moe, and each call's KT_PROFILE line (the backward's: setup, experts per worker
#      as decode / products / elementwise / copies, sum; "saved" marks the one reading them). Measured before
#      (f3c8000, H200 host, 16-core Xeon with AMX): fused_moe 14.15, fused_moe_delta 20.54, backward 155.85, plain
#      backward 118.97 ms; the backward per worker: decode 37.9, products 48.8 ms.
#   3. what decides the backward's decode layout (W2 and W13 decoded transposed since a60ee24, read as (W^T)^T):
#      bench_train's --layout-row line, the two transposed products on one thread (as each expert task runs them)
#      at Qwen3's shape (n = 128 rows), bf16, with the weights transposed (now) and row-major (before). If the two
#      tie there (oneDNN on AMX takes either layout), the change is worth only its decode time: compare step 2's
#      experts.decode with the 37.9 ms above; if "transposed" wins, it stays. Here (AVX2, ATen's bf16 fallback):
#      5.4 / 26.0 and 15.3 / 133.5 ms at n = 64, H = 1024, I = 384.
#
#   bash benchmarks/device_delta.sh        # from the repo root, ktorch built; logs under $OUT (at most ~235 s)
set -uo pipefail
OUT=${OUT:-/tmp/device_delta_out}
mkdir -p "$OUT"
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
START=$(date +%s)
lscpu | grep -E "Model name|^CPU\(s\)" | tr -s ' '
python3 -c "import torch, ktorch; print('torch', torch.__version__, 'kernel levels', ktorch.cpu_features()['available'])"

echo "== 1. tests (limit 110 s)"
timeout -k 5 110 python3 -m pytest -q -p no:cacheprovider tests/test_ops_fused_moe_backward.py \
  -k "delta_forward or delta_dtypes or packed_delta or autograd_through or decode or fewer_experts or exact_gguf or saved" \
  >"$OUT/tests.log" 2>&1
echo "   rc $? ($(($(date +%s) - START)) s)"
grep -E "passed|failed|error" "$OUT/tests.log" | tail -3
grep -E "^FAILED" "$OUT/tests.log" | head -10

echo "== 2./3. one layer's CPU calls, the products in both layouts (limit 100 s)"
timeout -k 5 100 python3 benchmarks/bench_train.py --variants ops --seq 2048 --experts-dtype int8 --op-reps 3 \
  --recompute-row --layout-row --profile >"$OUT/ops.log" 2>&1
echo "   rc $? ($(($(date +%s) - START)) s)"
grep -v "^machine:" "$OUT/ops.log" | tail -10
echo "device_delta.sh: $(($(date +%s) - START)) s"
