# Issue 3, T=2048: how the AMX walks fetch weights ahead (KT_AMX_NEXT_PF, KT_AMX_B_L1_PF; amx/kernels.cpp).
# 1. one thread streaming weights from memory (amx/test --bench-cold), GB/s per walk variant, M = 16 and 128;
# 2. the Qwen3 layer at T=512/2048 (int8, bf16) under the same knobs, cold caches, all threads, phase medians
#    (the default timed first and last to show the run's spread). Logs: $OUT/prefetch_cold.log,
#    $OUT/prefetch_layer.log. About 5 minutes after device_check's build.
#   PREFETCH_WALKS="rows rows@KT_AMX_NEXT_PF=2 ..."   the variants of 1 (amx/test KT_BENCH_WALKS)
#   PREFETCH_VARIANTS="- KT_AMX_NEXT_PF=2 ... -"       the variants of 2 (bench_fused_moe.py --env-variants)
OUT=${OUT:-/tmp/out}
walks=${PREFETCH_WALKS:-rows rows@KT_AMX_NEXT_PF=2 rows@KT_AMX_NEXT_PF=4 rows@KT_AMX_NEXT_PF=0 rows@KT_AMX_B_L1_PF=0 rows@KT_AMX_NEXT_PF=0,KT_AMX_B_L1_PF=0 kblock kblock@KT_AMX_NEXT_PF=2}
variants=${PREFETCH_VARIANTS:-- KT_AMX_NEXT_PF=2 KT_AMX_NEXT_PF=0 KT_AMX_B_L1_PF=0 KT_AMX_NEXT_PF=2,KT_AMX_B_L1_PF=0 -}
echo "== $(date +%T) one thread, weights from memory"
KT_BENCH_M=${PREFETCH_M:-16,128} KT_BENCH_WALKS="$walks" timeout 150 bash ktorch/csrc/kernels/amx/test/run.sh native \
    --bench-cold 2>&1 | grep -v -i warning > "$OUT/prefetch_cold.log"
cat "$OUT/prefetch_cold.log"
echo "== $(date +%T) the layer: $variants"
KT_CPU_KERNEL=amx timeout ${PREFETCH_LAYER_TIMEOUT:-300} python3 benchmarks/bench_fused_moe.py --shapes qwen3 \
    --tokens ${PREFETCH_TOKENS:-512 2048} --impls ${PREFETCH_IMPLS:-ktorch-int8 ktorch-bf16} --env-variants $variants \
    --min-calls 5 --min-seconds 0.3 --profile > "$OUT/prefetch_layer.log" 2>&1
grep -E "^machine|^L3|^qwen3 |phases|failed|Error" "$OUT/prefetch_layer.log" | cut -c1-400
echo "== $(date +%T) prefetch done"
