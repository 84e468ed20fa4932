#!/usr/bin/env bash
# Device check of issue 32's GGUF K-quant scales at the file's size (two-level: a byte sub-scale per group, an fp32
# d/dmin per 256; docs/loading.md's exact formats), branch exp-kscales (which holds exp-mxfp4 too), in one call of at
# most 300 s (limits: 110 s for the tests, 75 for the AMX kernel test, 110 for the layer):
#   1. correctness at every kernel level the host has (portable, avx512, amx: the suite's `kernel` fixture):
#      tests/test_ops_kquant.py's two-level cases (the op's output on two-level scales equal to the float32-per-group
#      form's bit for bit at T = 1, 5, 300; unpack = gguf.quants.dequantize; opcheck; NUMA split) with its unpack,
#      opcheck, NUMA and streamed cases, tests/test_ops_mxfp4.py, and tests/test_load_gguf.py's exact loads (Q4_K_M
#      loads two-level per projection). Prints pytest's summary and any FAILED line.
#   2. the AMX kernel test on real tiles (ktorch/csrc/kernels/amx/test/run.sh native; the kernels are exp-mxfp4's,
#      unchanged here: the driver forms the float32 group scales before each call). Prints its case counts.
#   3. one Qwen3-30B-A3B layer (E=128, K=8, H=2048, I=768; random codes and scales) through
#      benchmarks/bench_fused_moe.py (cold caches), Q4_K and Q6_K with float32 scales per group (ktorch-q4_k,
#      ktorch-q6_k: 0.75 and 1.25 bytes a weight) against two-level (ktorch-q4_k_2l, ktorch-q6_k_2l: 0.594, 1.078)
#      at T = 1 (GB/s of the bytes read and "% BW" of the read bandwidth it measures first) and T = 512. Prints
#      its table.
#
#   bash benchmarks/device_kscales.sh        # from the repo root, ktorch built, the gguf wheel installed; logs under $OUT
set -uo pipefail
OUT=${OUT:-/tmp/device_kscales_out}
mkdir -p "$OUT"
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
START=$(date +%s)
lscpu | grep -E "Model name|^CPU\(s\)" | tr -s ' '
python3 -c "import torch, ktorch; print('torch', torch.__version__, 'kernel levels', ktorch.cpu_features()['available'])"
python3 -c "import gguf" 2>/dev/null || echo "WARNING: the gguf package is missing: the K-quant tests skip (install its wheel)"

echo "== 1. tests at every kernel level (limit 110 s)"
timeout -k 5 110 python3 -m pytest -q -p no:cacheprovider \
  tests/test_ops_kquant.py -k "kscales or unpack or opcheck or numa or streamed or tiles or mxfp4 or mixed" tests/test_ops_mxfp4.py \
  "tests/test_load_gguf.py::test_mixed_types_load_exactly" \
  >"$OUT/tests.log" 2>&1
echo "   rc $? ($(($(date +%s) - START)) s)"
grep -E "passed|failed|error" "$OUT/tests.log" | tail -3
grep -E "^FAILED|^ERROR" "$OUT/tests.log" | head -10

echo "== 2. AMX kernel test on real tiles (limit 75 s)"
if python3 -c "import ktorch, sys; sys.exit('amx' not in ktorch.cpu_features()['available'])"; then
  TMPDIR=$(mktemp -d) timeout -k 5 75 bash ktorch/csrc/kernels/amx/test/run.sh native >"$OUT/amx_kernels.log" 2>&1
  echo "   rc $? ($(($(date +%s) - START)) s)"
  grep -E "cases, [0-9]+ failed|^FAIL" "$OUT/amx_kernels.log" | head -12
else
  echo "   skipped: no AMX on this host"
fi

echo "== 3. one Qwen3-30B-A3B layer: two-level K-quant scales vs float32 per group (limit 110 s)"
timeout -k 5 110 python3 benchmarks/bench_fused_moe.py --shapes qwen3 --tokens 1 512 \
  --impls ktorch-q4_k ktorch-q4_k_2l ktorch-q6_k ktorch-q6_k_2l --min-calls 5 --min-seconds 0.4 >"$OUT/layer.log" 2>&1
echo "   rc $? ($(($(date +%s) - START)) s)"
grep -E "^machine|read bandwidth" "$OUT/layer.log"
grep -E "^\|" "$OUT/layer.log" || tail -20 "$OUT/layer.log"
echo "device_kscales.sh: $(($(date +%s) - START)) s"
