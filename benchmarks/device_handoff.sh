#!/usr/bin/env bash
# Device check of the GPU handoff of captured CPU experts calls (compile/gpu_handoff.py, runtime/host_tasks.cpp:
# a doorbell kernel starts the C++ task thread's call, a wait kernel spins on the pinned done word; no host
# function in the graph) against the host-function handoff it replaces (start and join in one C host function),
# in one call of at most 200 s (the stages' limits add up to 190 s):
#   1. tests (limit 45 s): tests/test_gpu_handoff.py on CUDA (the kernels against the real worker, the bounded
#      spin's error flag, pageable words refused; a CUDA graph of 6 layers' submit/wait with the handoff equal bit for
#      bit to the host-function graph over 20 replays, d = 0 and deferral d = 2; ktorch.generate's captured tokens
#      equal the eager ones both ways, deferred 0 and 1; the kernels' PTX; a failing self-test falls back) and
#      tests/test_host_tasks.py's handoff and start/join tests (the worker's protocol). Prints pytest's summary and
#      the failures.
#   2. a random 12-layer Qwen3-30B-A3B-shaped Q8_0 file (/tmp/h12.gguf, bench_generate.py --write-layers 12, ~8 GB,
#      ~25 s, limit 35 s; kept if present).
#   3. bench_generate.py --ab-compile, every expert on the CPU (--ab-gpu-memory off; limit 65 s): "default" (the GPU
#      handoff) against "host-function handoff", 3 alternations in one process, d = 0: decode tok/s per run and the
#      medians, then a 20-replay profile of each (step wall ms, CPU experts ms, GPU kernels and kernel count per
#      step; the first process compiles the decoder layers, later ones read Inductor's cache).
#   4. the same with layers partly resident (--ab-gpu-memory 4GiB; limit 45 s), 2 alternations: here the CPU calls
#      have little to do and the handoff's latency is most of their cost.
# Before this change (session 29, H200 host, 48 layers): with every expert in host memory 30.1 ms a step, of which
# 21.8 ms CPU experts and 4.0 ms GPU kernels (~83 us a layer of handoff); with 73 of 128 experts a layer resident
# ~170 us a layer for CPU calls with almost nothing to do.
#
#   bash benchmarks/device_handoff.sh        # from the repo root, ktorch built; logs under $OUT
set -uo pipefail
OUT=${OUT:-/tmp/device_handoff_out}
mkdir -p "$OUT"
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
START=$(date +%s)
lscpu | grep -E "Model name|^CPU\(s\)" | tr -s ' '
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -1
python3 -c "import torch, triton, ktorch; print('torch', torch.__version__, 'triton', triton.__version__, 'kernel levels', ktorch.cpu_features()['available'])"

echo "== 1. tests (limit 45 s)"
timeout -k 5 45 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_handoff.py tests/test_host_tasks.py \
  -k "handoff or wait_kernel or ring or kernels_compile or pageable or graph_with or generate_through or start_join or self_test" \
  >"$OUT/tests.log" 2>&1
echo "   rc $? ($(($(date +%s) - START)) s)"
grep -E "passed|failed|error" "$OUT/tests.log" | tail -3
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -10

FILE=/tmp/h12.gguf
echo "== 2. the file ($FILE)"
if [ ! -f "$FILE" ]; then
  timeout -k 5 35 python3 benchmarks/bench_generate.py --gguf "$FILE" --write-layers 12 --write-seed 11 --skip-ktorch \
    >"$OUT/write.log" 2>&1
  echo "   rc $? ($(($(date +%s) - START)) s)"
  tail -1 "$OUT/write.log"
fi

ab() {  # label, limit, args...
  local label=$1 limit=$2
  shift 2
  echo "== $label (limit $limit s)"
  timeout -k 5 "$limit" python3 -u benchmarks/bench_generate.py --gguf "$FILE" \
    --ab-variants default "host-function handoff" --prompts 64 --gen 96 --profile-steps 20 --deferred 0 "$@" \
    >"$OUT/$label.log" 2>&1
  echo "   rc $? ($(($(date +%s) - START)) s)"
  grep -E "^d=|^\[profile|Error|error:" "$OUT/$label.log" | head -20
}
ab "3.off" 65 --ab-gpu-memory off --ab-compile 3
ab "4.4GiB" 45 --ab-gpu-memory 4GiB --ab-compile 2
echo "device_handoff.sh: $(($(date +%s) - START)) s"
