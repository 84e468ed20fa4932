# Issue-2 table on the device: the AVX-512 path vs transformers' eager / grouped_mm, Qwen3-30B-A3B layer.
KT_CPU_KERNEL=avx512 python3 benchmarks/bench_fused_moe.py --shapes qwen3 --min-seconds 0.5 2>&1 | grep -vE "^qwen3|^deepseek"
