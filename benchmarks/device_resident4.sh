#!/usr/bin/env bash
# Device check of 4-bit (and affine) resident decode (docs/resident_decode.md), ONE call, limit 300 s (H100/H200 +
# Xeon):
#   1. the CUDA tests of resident rows, every format (limit 100 s): tests/test_resident_rows.py (the Triton kernels
#      for int8, int4 per 32/128, Q4_0, Q4_K, Q5_K and the Q4_K_M mix against a float64 reference and the packed
#      path's error; the Qwen3 shape at T=16; CUDA-graph replay int8/Q4_K; a tiny model with every expert resident,
#      int8/int4 (Triton) and bf16 (packed), decoding eagerly and captured with no CPU op call). pytest's summary and
#      any failure.
#   2. one Qwen3-30B-A3B layer (128 experts resident, H 2048, I 768, top-8) in int8 (scale per 32), int4 (per 128)
#      and Q4_K (scale + min per 32), T=1 and T=4, under a CUDA graph (limit 80 s): us per layer of the packed path
#      and the Triton kernels (each format's tile, and 8/256/4 for the 4-bit ones), GB/s of codes+scales, rel. error.
#   3. while time is left (runs start only with 45 s to spare; the file is written first, about a minute): fresh
#      `ktorch generate` processes on a random 12-layer Qwen3-30B-A3B-shaped Q4_K file (bench_generate.py
#      --write-type Q4_K, P=512, 64 new tokens, random prompt), in order: --gpu-memory auto (every expert resident:
#      Triton decode, no CPU op), off (every expert on the CPU), 4GiB (part resident). Prints each run's
#      prefill/decode tok/s and the decode resident hit rate.
#
#   bash benchmarks/device_resident4.sh       # from the repo root, ktorch built; logs under $OUT
#   LIMIT=300 (the whole script's wall clock), LAYERS=12, TESTS=0 skips step 1, GEN=0 skips step 3
set -uo pipefail
OUT=${OUT:-/tmp/device_resident4_out}
mkdir -p "$OUT"
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
START=$(date +%s)
LIMIT=${LIMIT:-300}
LAYERS=${LAYERS:-12}
left() { echo $((LIMIT - ($(date +%s) - START))); }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
lscpu | grep -E "Model name|^CPU\(s\)" | tr -s ' '
python3 -c "import torch, ktorch, importlib.util as u; print('torch', torch.__version__, 'triton', bool(u.find_spec('triton')), ktorch.__file__)"
git log --oneline -1

if [ "${TESTS:-1}" = 1 ]; then
  echo "== 1. tests of resident rows, CUDA included (limit 100 s)"
  timeout -k 5 100 python3 -m pytest -q -p no:cacheprovider tests/test_resident_rows.py >"$OUT/tests.log" 2>&1
  echo "   rc $? ($(($(date +%s) - START)) s)"
  grep -E "passed|failed|error" "$OUT/tests.log" | tail -3
  grep -E "^(FAILED|ERROR)|Error:" "$OUT/tests.log" | head -12
fi

echo "== 2. one layer, resident decode under a CUDA graph, int8 / int4 / q4_k (limit 80 s)"
timeout -k 5 80 python3 benchmarks/bench_resident_decode.py --formats int8 int4 q4_k --tokens 1 4 --tiles 8/256/4 \
  --replays 30 2>&1 | tee "$OUT/micro.log" | head -60
echo "   ($(($(date +%s) - START)) s)"

if [ "${GEN:-1}" = 1 ]; then
  FILE=/tmp/q4k-${LAYERS}l-skew0.gguf
  echo "== 3. ktorch generate, $LAYERS-layer Q4_K file, P=512, 64 tokens (while time is left: $(left) s)"
  SETTINGS=("--gpu-memory auto" "--gpu-memory off" "--gpu-memory 4GiB")
  WRITE=(--write-layers "$LAYERS" --write-type Q4_K)
  for S in "${SETTINGS[@]}"; do
    need=45; [ -f "$FILE" ] || need=110  # writing the file takes about a minute
    if [ "$(left)" -lt "$need" ]; then echo "   [$S] skipped: $(left) s left"; continue; fi
    timeout -k 5 $(( $(left) - 5 )) python3 benchmarks/bench_generate.py --gguf "$FILE" "${WRITE[@]}" --runs 1 \
      --prompts 512 --gen 64 --prompt-kind random --timeout $(( $(left) - 10 )) --json "$OUT/generate.jsonl" \
      --ktorch-args "$S" >>"$OUT/generate.log" 2>&1
    echo "   [$S] rc $? ($(($(date +%s) - START)) s)"
    grep -E "wrote " "$OUT/generate.log" | tail -1 | sed 's/^/   /'
    tail -4 "$OUT/generate.log" | grep -E "P=512|resident|rror" | sed 's/^/   /'
    WRITE=()
  done
  rm -f "$FILE"
fi
echo "done in $(($(date +%s) - START)) s; logs under $OUT"
