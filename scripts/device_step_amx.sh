# AMX kernels against a float64 reference and the AVX-512 kernels, on real tiles; then one-thread timings.
bash ktorch/csrc/kernels/amx/test/run.sh native 2>&1 | tail -8
bash ktorch/csrc/kernels/amx/test/run.sh native --bench 2>&1 | tail -40
