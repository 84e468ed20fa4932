#!/usr/bin/env bash
# Device check of issue 32's MXFP4 experts as 4-bit codes (docs/loading.md, the exact formats' table), in one call of
# at most 300 s (limits: 100 s for the op tests, 75 for the AMX kernel test, 120 for the layer):
#   1. correctness at every kernel level the host has (portable, avx512, amx: the suite's `kernel` fixture):
#      tests/test_ops_mxfp4.py (the op on the nibbles equal to the op on the int8 codes of the same blocks bit for bit,
#      AMX tiles forced for every call too; opcheck; backward, delta, NUMA split, device forms), the MXFP4 cases of
#      tests/test_ops_kquant.py (unpack = gguf.quants.dequantize, the op against the float64 reference) and
#      tests/test_load_gguf_gpt_oss.py (a tiny gpt-oss GGUF loads as nibbles, 0.625 bytes a weight) and
#      tests/test_load_safetensors_mxfp4.py (OpenAI's MXFP4 blocks in a safetensors folder, likewise). Prints pytest's
#      summary and any FAILED line.
#   2. the AMX kernel test on real tiles (ktorch/csrc/kernels/amx/test/run.sh native: every int4 walk, MXFP4's code
#      table among them, against a double reference and the AVX-512 kernels bit for bit). Prints its case counts.
#   3. one gpt-oss-120b-shaped layer (E=128, K=4, H=I=2880; random MXFP4 blocks, silu, no biases) through
#      benchmarks/bench_fused_moe.py (cold caches: a fresh routing a call, layer copies past 16x L3), the 4-bit codes
#      (ktorch-mxfp4) against the int8 codes (ktorch-mxfp4_int8) at T = 1 (decode: GB/s of the experts read and "% BW"
#      of the read bandwidth the script measures first), 512 and 2048 (prefill: AMX tiles for the nibbles, the
#      AVX-512 grouped kernel for the int8 codes). Prints its table.
#
#   bash benchmarks/device_mxfp4.sh        # from the repo root, ktorch built, the gguf wheel installed; logs under $OUT
set -uo pipefail
OUT=${OUT:-/tmp/device_mxfp4_out}
mkdir -p "$OUT"
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
START=$(date +%s)
lscpu | grep -E "Model name|^CPU\(s\)" | tr -s ' '
python3 -c "import torch, ktorch; print('torch', torch.__version__, 'kernel levels', ktorch.cpu_features()['available'])"
python3 -c "import gguf" 2>/dev/null || echo "WARNING: the gguf package is missing: the MXFP4 tests skip (install its wheel)"

echo "== 1. tests at every kernel level (limit 100 s)"
timeout -k 5 100 python3 -m pytest -q -p no:cacheprovider tests/test_ops_mxfp4.py \
  "tests/test_ops_kquant.py" -k "mxfp4 or not kquant" \
  "tests/test_load_gguf_gpt_oss.py::test_config_and_exact_experts" tests/test_load_safetensors_mxfp4.py \
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

echo "== 3. one gpt-oss-120b layer: 4-bit codes vs int8 codes (limit 120 s)"
timeout -k 5 120 python3 benchmarks/bench_fused_moe.py --shapes gpt-oss-120b --tokens 1 512 2048 \
  --impls ktorch-mxfp4 ktorch-mxfp4_int8 --min-calls 5 --min-seconds 0.5 >"$OUT/layer.log" 2>&1
echo "   rc $? ($(($(date +%s) - START)) s)"
grep -E "^machine|read bandwidth" "$OUT/layer.log"
grep -E "^\|" "$OUT/layer.log" || tail -20 "$OUT/layer.log"
echo "device_mxfp4.sh: $(($(date +%s) - START)) s"
