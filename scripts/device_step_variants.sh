# The Qwen3 layer under environment variants of the op's knobs, side by side in one process (cold caches, all
# threads, phase medians; the first variant is usually '-', the defaults, and timed again last to show the run's
# spread). Log: $OUT/variants.log (this step's output).
#   VARIANTS="- KT_DOWN_PIPELINE=0 ... -"  VARIANT_TOKENS="512 2048"  VARIANT_IMPLS="ktorch-int8 ktorch-bf16"
#   VARIANT_PAGES="huge 4k" (the packed weights' pages; default huge, as ktorch's pack ops allocate them)
echo "== $(date +%T) the layer: ${VARIANTS:--}"
KT_CPU_KERNEL=amx timeout ${VARIANT_TIMEOUT:-400} python3 benchmarks/bench_fused_moe.py --shapes ${VARIANT_SHAPES:-qwen3} \
    --tokens ${VARIANT_TOKENS:-512 2048} --impls ${VARIANT_IMPLS:-ktorch-int8 ktorch-bf16} --env-variants ${VARIANTS:--} \
    --pages ${VARIANT_PAGES:-huge} --min-calls 5 --min-seconds 0.3 --profile 2>&1 | grep -E "^machine|^L3|^qwen3 |^deepseek |phases|huge pages|Error|error" | cut -c1-4000
echo "== $(date +%T) variants done"
