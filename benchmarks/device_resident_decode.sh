#!/usr/bin/env bash
# Device check of the resident decode path (docs/resident_decode.md), ONE call, limit 420 s (H100/H200 + Xeon):
#   1. the CUDA tests of resident experts (limit 180 s): tests/test_resident_rows.py -k cuda (the Triton kernels
#      against a float64 reference and the packed path's error, every scales mode, four activations; a CUDA-graph
#      replay; a tiny model with every expert resident, int8 (Triton) and bf16 (packed), decoding eagerly and
#      captured with no CPU op call) and tests/test_routed_experts.py -k cuda (the prefill split with residents, the
#      budget, residents swapped in place under a kept CUDA graph). Prints pytest's summary and any failure.
#   2. one Qwen3-30B-A3B layer (128 int8 experts resident, H 2048, I 768, scale per 32, top-8) at T=1 and T=4 under a
#      CUDA graph (12 layer calls per graph; limit 80 s): us per layer of the packed path, the Triton kernels (the
#      library's tile) and bf16 residents (gather; grouped_mm), with each one's relative error; then the kernels of
#      one eager call of packed / triton (torch.profiler).
#   3. while time is left (runs start only with 45 s to spare): fresh `ktorch generate` processes on a random 12-layer
#      Qwen3-30B-A3B-shaped Q8_0 file (benchmarks/bench_generate.py, P=512, 64 new tokens, random prompt), in order:
#      --gpu-memory auto (every expert resident: Triton decode, no CPU op), 8GiB (52 residents a layer),
#      off (every expert on the CPU). Prints each run's prefill/decode tok/s and the decode resident hit rate.
#
#   bash benchmarks/device_resident_decode.sh       # from the repo root, ktorch built; logs under $OUT
#   LIMIT=420 (the whole script's wall clock), LAYERS=12, TESTS=0 skips step 1, GEN=0 skips step 3
set -uo pipefail
OUT=${OUT:-/tmp/device_resident_decode_out}
mkdir -p "$OUT"
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
START=$(date +%s)
LIMIT=${LIMIT:-420}
LAYERS=${LAYERS:-12}
left() { echo $((LIMIT - ($(date +%s) - START))); }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
lscpu | grep -E "Model name|^CPU\(s\)" | tr -s ' '
python3 -c "import torch, ktorch, importlib.util as u; print('torch', torch.__version__, 'triton', bool(u.find_spec('triton')), ktorch.__file__)"

if [ "${TESTS:-1}" = 1 ]; then
  echo "== 1. CUDA tests of resident experts (limit 180 s)"
  timeout -k 5 180 python3 -m pytest -q -p no:cacheprovider tests/test_resident_rows.py tests/test_routed_experts.py \
    -k cuda >"$OUT/tests.log" 2>&1
  echo "   rc $? ($(($(date +%s) - START)) s)"
  grep -E "passed|failed|error" "$OUT/tests.log" | tail -3
  grep -E "^(FAILED|ERROR)|Error:" "$OUT/tests.log" | head -12
fi

echo "== 2. one layer, resident decode under a CUDA graph (limit 80 s)"
timeout -k 5 80 python3 benchmarks/bench_resident_decode.py --tokens 1 4 --profile 2>&1 | tee "$OUT/micro.log" \
  | grep -vE "^\s+[0-9.]+ us  " | head -40
grep -E "^\s+[0-9.]+ us  " "$OUT/micro.log" | head -40
echo "   ($(($(date +%s) - START)) s)"

if [ "${GEN:-1}" = 1 ]; then
  FILE=/tmp/q8-${LAYERS}l-skew0.gguf
  echo "== 3. ktorch generate, $LAYERS-layer Q8_0 file, P=512, 64 tokens (while time is left: $(left) s)"
  SETTINGS=("--gpu-memory auto" "--gpu-memory 8GiB" "--gpu-memory off")
  WRITE=(--write-layers "$LAYERS" --write-type Q8_0)
  for S in "${SETTINGS[@]}"; do
    need=45; [ -f "$FILE" ] || need=110  # writing the file takes about a minute
    if [ "$(left)" -lt "$need" ]; then echo "   [$S] skipped: $(left) s left"; continue; fi
    timeout -k 5 $(( $(left) - 5 )) python3 benchmarks/bench_generate.py --gguf "$FILE" "${WRITE[@]}" --runs 1 \
      --prompts 512 --gen 64 --prompt-kind random --timeout $(( $(left) - 10 )) --json "$OUT/generate.jsonl" \
      --ktorch-args "$S" >>"$OUT/generate.log" 2>&1
    grep -E "wrote " "$OUT/generate.log" | tail -1 | sed 's/^/   /'
    tail -4 "$OUT/generate.log" | grep -E "P=512|resident|rror" | sed 's/^/   /'
    WRITE=()
  done
  rm -f "$FILE"
fi
echo "done in $(($(date +%s) - START)) s; logs under $OUT"
