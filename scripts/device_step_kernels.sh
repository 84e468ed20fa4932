# Kernel figures on the device in one step (issues 2 and 3): the per-call overhead, the issue-2 table on the
# AVX-512 path with phase times, then ktorch (auto = AMX, and AVX-512) vs kt-kernel side by side, cold caches.
# Needs carry .peers/kt_kernel for the last part (skipped with a message without it). KERNELS_OVERHEAD=0 skips the
# overhead bench; KERNELS_TOKENS, KERNELS_SHAPES (default qwen3), KERNELS_FORMATS (default all) and
# KERNELS_COLD (the layers cycled, x L3: default 16) set the kt-kernel comparison.
[ "${KERNELS_OVERHEAD:-1}" = 0 ] || python3 benchmarks/bench_overhead.py --threads 1,8,15,16 --calls 5000
KT_CPU_KERNEL=avx512 timeout ${KERNELS_AVX_TIMEOUT:-200} python3 benchmarks/bench_fused_moe.py --shapes qwen3 --impls ktorch-bf16 ktorch-int8 ktorch-int4 eager grouped_mm \
    --min-seconds 0.3 --profile 2>&1  # each row prints as it comes, so a cut run keeps what it measured
timeout ${KERNELS_KT_TIMEOUT:-300} python3 benchmarks/bench_vs_kt_kernel.py --shapes ${KERNELS_SHAPES:-qwen3} \
    --formats ${KERNELS_FORMATS:-bf16 int8 int4} --tokens ${KERNELS_TOKENS:-1 32 512 2048} --ktorch-variants auto avx512 \
    --kt-threads 15 --cold-factor ${KERNELS_COLD:-16} --min-seconds 0.3 2>&1
