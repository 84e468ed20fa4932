#!/usr/bin/env bash
# Device check of the GGUF-exact expert formats (docs/loading.md, "the file's values, exactly"). Wall-clock limit:
# 8 minutes (about 2 for the tests, 1 for the bandwidth, 4 for the layer timings). Run from the repo root after the
# wheels (.whl/, gguf among them) are installed and ktorch is built in place:
#   bash benchmarks/device_kquant.sh
# Prints, and writes under $OUT (default /tmp/kquant_out):
#   1. tests/test_ops_kquant.py at every kernel level the CPU has (avx512 and amx: the affine int4 tile epilogue,
#      the grouped int8 AVX-512 kernel), with the pass/fail counts; the GGUF load tests of the exact formats.
#   2. the CPU's DRAM read bandwidth (bench_host_bandwidth.py, CPU row).
#   3. one Qwen3-30B-A3B layer (E=128, K=8, H=2048, I=768) at T = 1, 512, 2048 for int8, int4 (g128) and each exact
#      format (q8_0, q6_k, q5_k, q4_k, q4_k_m = Q4_K gate/up + Q6_K down, q4_0): ms, GB/s and % of read bandwidth.
#      The bars: decode (T=1) of each exact format within 10% of its bytes over the read bandwidth (the
#      "% BW" column >= 90), and q4_k at T=512/2048 no slower than int8.
set -uo pipefail
OUT=${OUT:-/tmp/kquant_out}
mkdir -p "$OUT"
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
start=$(date +%s)
python3 -c "import gguf" 2>/dev/null || echo "WARNING: the gguf package is missing: tests/test_ops_kquant.py skips (install its wheel)"
python3 -c "import ktorch, torch; print('kernel', torch.ops.kt.selected_kernel(), 'threads', ktorch.get_num_threads()); print(ktorch.cpu_features())"

echo "== 1. op tests (every kernel level) and GGUF load tests of the exact formats"
timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_ops_kquant.py \
  "tests/test_load_gguf.py::test_mixed_types_load_exactly" "tests/test_load_gguf.py::test_exact_experts_logits_match_hf_eager" \
  > "$OUT/tests.log" 2>&1
echo "pytest exit $?"; tail -5 "$OUT/tests.log"
grep -E "FAILED|Error" "$OUT/tests.log" | head -20

echo "== 2. DRAM read bandwidth (CPU row)"
timeout 90 python3 benchmarks/bench_host_bandwidth.py --no-gpu --cpu-gib 4 --repeats 3 > "$OUT/bandwidth.log" 2>&1
echo "exit $?"; tail -8 "$OUT/bandwidth.log"

echo "== 3. one Qwen3 layer per format (ms, GB/s, % of the read bandwidth it measures itself)"
timeout 270 python3 benchmarks/bench_fused_moe.py --shapes qwen3 --tokens 1 512 2048 --min-calls 5 --min-seconds 0.5 \
  --impls ktorch-int8 ktorch-int4 ktorch-q8_0 ktorch-q4_k ktorch-q4_k_m ktorch-q6_k ktorch-q5_k ktorch-q4_0 \
  > "$OUT/layer.log" 2>&1
echo "exit $?"; grep -E "^\|" "$OUT/layer.log" || tail -30 "$OUT/layer.log"
echo "total $(( $(date +%s) - start )) s"
