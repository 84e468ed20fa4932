# ktorch (AVX-512 and AMX at several small-M thresholds) vs kt-kernel, Qwen3 layer. Needs carry .peers/kt_kernel.
python3 benchmarks/bench_vs_kt_kernel.py --shapes qwen3 --tokens 1 32 128 512 2048 --ktorch-variants avx512 amx:1 amx:4 amx:16 --kt-threads 15 16 --cold-factor 16 2>&1
