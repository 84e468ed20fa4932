# Issue 3, T=2048: the layer against this instance's own ceilings, in one call on one machine. The bare L1 tile loop
# on 16 threads (int8 and bf16: no layer can beat it), the kernel's walk at M = 128 on hot and cold weights
# (--bench-stretch, 16 threads), the DRAM read bandwidth, then ktorch and kt-kernel side by side on the Qwen3 layer
# at BOUND_TOKENS (cold caches, as `kernels`), then the bare loop again (the host's tile rate moves between minutes).
# Needs carry .peers/kt_kernel. Log: $OUT/bound.log. About 5 minutes after device_check's build.
#   BOUND_TOKENS="512 2048"  BOUND_FORMATS="int8 bf16"  BOUND_ROUNDS=8
bin=${TMPDIR:-/tmp}/kt_amx_kernels_test_native  # what run.sh native builds; built once, by the first run
quiet() { grep -v -i -e warning -e "^ *|" -e "^In " -e "inlined from" -e "^/usr" -e "^ *[0-9]* |"; }
echo "== $(date +%T) bare tile loop, 16 threads"
timeout 90 bash ktorch/csrc/kernels/amx/test/run.sh native --bench-peak16 2>&1 | quiet
echo "== $(date +%T) walk at M = 128, hot and cold weights"
KT_BENCH_THREADS=16 KT_BENCH_ROUNDS=${BOUND_ROUNDS:-8} KT_BENCH_VNNI=0 timeout 60 "$bin" --bench-stretch 2>&1
echo "== $(date +%T) read bandwidth"
timeout 60 python3 benchmarks/bench_host_bandwidth.py --threads 16 --no-gpu 2>&1 | tail -5
echo "== $(date +%T) the layer, ktorch and kt-kernel"
timeout ${BOUND_KT_TIMEOUT:-300} python3 benchmarks/bench_vs_kt_kernel.py --shapes qwen3 --formats ${BOUND_FORMATS:-int8 bf16} \
    --tokens ${BOUND_TOKENS:-512 2048} --ktorch-variants auto --kt-threads 15 --cold-factor 16 --min-seconds 0.3 2>&1
echo "== $(date +%T) bare tile loop, 16 threads, again"
timeout 60 "$bin" --bench-peak16 2>&1
echo "== $(date +%T) bound done"
