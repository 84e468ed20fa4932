#!/usr/bin/env bash
# Device check of prefill on int8 resident experts (issue 36; docs/resident_decode.md), ONE call, limit 120 s
# (H100/H200 + Xeon):
#   1. the CUDA tests (limit 60 s): tests/test_triton_prefill.py (the Triton grouped GEMM for int8 rows against a
#      float64 reference: Q8_0-style groups of 32 with BLOCK_K 64 and 32, per channel, Q6_K's 16, Q5_K's affine
#      codes, odd sizes, T 17/64/300, K 2 and 8, -1 slots and unused experts; the same bits twice; the Qwen3 shape at
#      T=512 and its CUDA-graph replay; rows_experts_forward's routing; a tiny model's prefill through it; the
#      used-residents dequantization bit for bit on CUDA's grouped_mm) and tests/test_resident_rows.py -k
#      'prefill or used_experts'. pytest's summary and any failure.
#   2. one Qwen3-30B-A3B layer (128 int8 experts resident, scale per 32, H 2048, I 768, top-8) at T=512 and 2048
#      (limit 45 s): us a layer (CUDA events, eager) of dequantize-all (the path before), dequantize-used, the Triton
#      grouped GEMM (tile_for's tile and others: BLOCK_M/BLOCK_N/BLOCK_K/warps/stages) and bf16 grouped_mm; GB/s of
#      codes+scales; rel. error vs float64.
#
#   bash benchmarks/device_resprefill.sh      # from the repo root, ktorch built; logs under $OUT
set -uo pipefail
OUT=${OUT:-/tmp/device_resprefill_out}
mkdir -p "$OUT"
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
START=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, ktorch, importlib.util as u; print('torch', torch.__version__, 'triton', bool(u.find_spec('triton')), ktorch.__file__)"
git log --oneline -1

echo "== 1. CUDA tests of the prefill paths (limit 60 s)"
timeout -k 5 60 python3 -m pytest -q -p no:cacheprovider tests/test_triton_prefill.py tests/test_resident_rows.py \
  -k "grouped or align or tile_for or prefill or used_experts" >"$OUT/tests.log" 2>&1
echo "   rc $? ($(($(date +%s) - START)) s)"
grep -E "passed|failed|error" "$OUT/tests.log" | tail -3
grep -E "^(FAILED|ERROR)|Error:" "$OUT/tests.log" | head -12

echo "== 2. one layer, prefill with 128 int8 residents (limit 45 s)"
timeout -k 5 45 python3 -u benchmarks/bench_resident_prefill.py --tokens 512 2048 --iters 10 \
  --tiles 32/64/32/4/3 64/128/64/4/3 64/64/128/8/3 2>&1 | tee "$OUT/micro.log" | head -40
echo "done in $(($(date +%s) - START)) s; logs under $OUT"
