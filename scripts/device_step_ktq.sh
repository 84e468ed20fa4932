# ktorch (AVX-512 and AMX at several small-M thresholds) vs kt-kernel, Qwen3 layer. Needs carry .peers/kt_kernel.
python3 benchmarks/bench_vs_kt_kernel.py --shapes qwen3 --tokens 1 32 128 512 2048 --ktorch-variants auto avx512 --kt-threads 15 --cold-factor 16 --min-seconds 0.5 2>&1
