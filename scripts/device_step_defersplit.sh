# What deferral costs the CPU per layer (issue 5): benchmarks/bench_defer_split.py on the idle machine, a decode
# layer's experts as one call (one pool dispatch, or KT_ONE_DISPATCH=0: a dispatch a stage) and as a split task with
# d = DS_DEFERRED in one call (fused_moe_split) or two (KT_DEFER_CALLS=2), cold caches; DS_ARGS=--huge-pages: the
# 4 KiB-page against huge-page A/B instead.
cd benchmarks
python3 bench_defer_split.py --shapes ${DS_SHAPES:-qwen3 deepseek-v2-lite} --tokens ${DS_TOKENS:-1} \
    --threads ${DS_THREADS:-13 16} --deferred ${DS_DEFERRED:-2} --calls ${DS_CALLS:-400} ${DS_ARGS:-} 2>&1 \
    | grep -vE "Warning|warn"
