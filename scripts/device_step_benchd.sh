# Issue-2 table on the device: the AVX-512 path vs transformers' eager, DeepSeek-V3 layer.
KT_CPU_KERNEL=avx512 python3 benchmarks/bench_fused_moe.py --shapes deepseek --tokens 1 32 512 --impls ktorch-bf16 ktorch-int8 ktorch-int4 eager --min-calls 3 --min-seconds 0.3 2>&1 | grep -vE "^qwen3|^deepseek"
