# Issue 3, the prefill (compute-bound) goals against what this machine's tiles can do: 1. the AMX tile ceiling
# (amx/test --bench-peak-threads: one thread's L1-resident 2 x 2 tile loop sampled over time, then 1..16
# threads at once, int8 and bf16); 2. the layer at T=512/2048 under down-projection task grids
# (KT_DOWN_RANGES x KT_DOWN_GROUPS, read by the op per call) with phase medians, cold caches, all threads.
# Logs: $OUT/ceiling_threads.log, $OUT/ceiling_grid.log. About 4 minutes after device_check's build.
#   CEILING_GRIDS="- KT_DOWN_RANGES=32 ..."   the grids of 2. ('-': the default, 16 x 2 on 16 workers)
OUT=${OUT:-/tmp/out}
grids=${CEILING_GRIDS:-- KT_DOWN_RANGES=32 KT_DOWN_GROUPS=4 KT_DOWN_RANGES=32,KT_DOWN_GROUPS=1 KT_DOWN_RANGES=8,KT_DOWN_GROUPS=4}
echo "== $(date +%T) tile ceiling"
timeout 120 bash ktorch/csrc/kernels/amx/test/run.sh native --bench-peak-threads 2>&1 | grep -v -i warning \
    > "$OUT/ceiling_threads.log"
cat "$OUT/ceiling_threads.log"
echo "== $(date +%T) down grids: $grids"
KT_CPU_KERNEL=amx timeout 300 python3 benchmarks/bench_fused_moe.py --shapes qwen3 --tokens 512 2048 \
    --impls ktorch-int8 ktorch-bf16 --env-variants $grids --min-calls 5 --min-seconds 0.3 --profile \
    > "$OUT/ceiling_grid.log" 2>&1
grep -E "^machine|^L3|^qwen3 |phases|failed|Error" "$OUT/ceiling_grid.log" | cut -c1-400
echo "== $(date +%T) ceiling done"
