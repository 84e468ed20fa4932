#!/bin/bash
# Builds and runs amx_kernels_test.cpp (see its header) from the repository root or anywhere.
#   run.sh emulated          software tiles, AddressSanitizer; needs AVX-512 BF16/VNNI (not AMX)
#   run.sh native [--bench|--bench-cold]  real tiles; needs AMX hardware and a kernel that grants it
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
kernels=$(cd "$here/../.." && pwd)
mode=${1:?usage: run.sh emulated|native [--bench|--bench-cold]}
shift
out=${TMPDIR:-/tmp}/kt_amx_kernels_test_$mode
isa="-mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 -mavx512vnni -mfma"
case $mode in
  emulated)
    flags="-O1 -g -fsanitize=address,undefined -fno-omit-frame-pointer -DKTAMX_EMULATE $isa"
    # GCC >= 13 turns on ASan's use-after-return fake stack by default; its frames do not keep the 64-byte
    # alignment of the tile buffers, and an aligned AVX-512 access there faults (seen on the device's gcc 13).
    case $(${CXX:-g++} --version | head -1) in *clang*) flags="$flags -fsanitize-address-use-after-return=never" ;;
      *) flags="$flags --param asan-use-after-return=0" ;; esac ;;
  native) flags="-O3 $isa -mamx-tile -mamx-bf16 -mamx-int8" ;;
  *) echo "usage: run.sh emulated|native [--bench|--bench-cold]" >&2; exit 2 ;;
esac
${CXX:-g++} -std=c++17 $flags -pthread -o "$out" "$here/amx_kernels_test.cpp" "$kernels/amx/kernels.cpp" "$kernels/avx512/kernels.cpp"
"$out" "$@"
