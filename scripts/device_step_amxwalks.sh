# Issue 3, the large-M (prefill) AMX path: the tile walks (KT_AMX_WALK, docs/amx.md "Large M") side by side in
# one call. 1. the AMX kernel test on real tiles, every walk; 2. bench_fused_moe with the AMX kernels, each row
# timed under each walk on the same layers (cold caches, all threads) with KT_PROFILE phase medians: Qwen3-30B-A3B
# T=32/512/2048 and DeepSeek-V3 T=512, int8/bf16/int4; 3. one thread streaming weights from memory, GB/s per
# walk and M (amx/test --bench-cold: does a walk's prefetching raise what one core pulls?).
# Logs: $OUT/amxwalks_*.log. About 6 minutes after device_check's build; the timeouts below add up to 8.5.
#   AMX_WALKS="pairs rows kblock:4"   walks to compare in 2. on Qwen3 (default below; 1. and 3. use their own lists)
#   DEEPSEEK_WALKS="..."              the same for DeepSeek-V3 (default: the walks that change its streaming;
#                                     with ~16 rows an expert, kblock's L1 reuse has nothing to reuse)
#   AMXWALKS_ONE_THREAD=1              4. also the one-thread gemm timings per M and walk (hot weights, ~1 minute)
OUT=${OUT:-/tmp/out}
walks=${AMX_WALKS:-pairs rows rows+pfa kblock kblock+pfa}
ds_walks=${DEEPSEEK_WALKS:-pairs rows rows+pfa}
test_bin=${TMPDIR:-/tmp}/kt_amx_kernels_test_native  # built by run.sh native
echo "walks: qwen3 $walks; deepseek $ds_walks"
echo "== $(date +%T) AMX kernel test, real tiles"
timeout 90 bash ktorch/csrc/kernels/amx/test/run.sh native > "$OUT/amxwalks_kernel_test.log" 2>&1
tail -8 "$OUT/amxwalks_kernel_test.log"
echo "== $(date +%T) qwen3"
KT_CPU_KERNEL=amx timeout 200 python3 benchmarks/bench_fused_moe.py --shapes qwen3 --tokens 32 512 2048 \
    --impls ktorch-int8 ktorch-bf16 ktorch-int4 --amx-walks $walks --min-calls 5 --min-seconds 0.3 --profile \
    > "$OUT/amxwalks_qwen3.log" 2>&1
grep -E "^machine|^L3|^qwen3 |phases|failed|Error" "$OUT/amxwalks_qwen3.log"
echo "== $(date +%T) deepseek"
KT_CPU_KERNEL=amx timeout 170 python3 benchmarks/bench_fused_moe.py --shapes deepseek --tokens 512 \
    --impls ktorch-int8 ktorch-int4 ktorch-bf16 --amx-walks $ds_walks --min-calls 3 --min-seconds 0.3 --profile \
    > "$OUT/amxwalks_deepseek.log" 2>&1
grep -E "^deepseek |phases|skip|failed|Error" "$OUT/amxwalks_deepseek.log"
echo "== $(date +%T) one thread, weights from memory, GB/s per M and walk"
timeout 45 "$test_bin" --bench-cold > "$OUT/amxwalks_one_thread_cold.log" 2>&1
cat "$OUT/amxwalks_one_thread_cold.log"
if [ "${AMXWALKS_ONE_THREAD:-0}" = 1 ]; then
  echo "== $(date +%T) one thread, hot weights, GOPS per M and walk"
  timeout 120 "$test_bin" --bench > "$OUT/amxwalks_one_thread.log" 2>&1
  cat "$OUT/amxwalks_one_thread.log"
fi
echo "== $(date +%T) amxwalks done"
