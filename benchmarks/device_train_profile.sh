#!/usr/bin/env bash
# Issue 35's step breakdown, one device call (< 90 s a variant with an 8-layer model): ktorch's training step at the
# Qwen3-30B-A3B shape cut to 8 layers (int8 experts, LoRA r=8 on attention and experts, seq 2048), 1 warm-up + 1
# timed step, then one step under torch.profiler (bench_train.py --profile): phases' wall (forward, backward with the
# checkpoint's recompute inside, optimizer), the CPU experts' ops per phase, host<->GPU copies (bytes, GPU time), GPU
# kernel time, top ops by self time. Two variants, one process each, one after the other: ktorch, and
# ktorch_pageable (the host<->GPU crossings before ktorch/ops/host_transfer.py: pageable blocking copies, fp32 deltas),
# the A/B of session 33's crossings in one call (< 180 s). Arguments append to the bench call (e.g. --layers 4;
# --variants ktorch for the one variant). Output also in $OUT.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ! python3 -c "import peft" 2>/dev/null; then  # as device_train.sh: carry .whl/peft-*.whl
  wheel=$(ls .whl/peft-*.whl 2>/dev/null | head -1)
  if [ -n "$wheel" ]; then
    python3 -m pip install --no-deps --quiet --target /tmp/kt_peft "$wheel" >"$OUT/pip_peft.log" 2>&1
    export PYTHONPATH=/tmp/kt_peft${PYTHONPATH:+:$PYTHONPATH}
  fi
fi
python3 benchmarks/bench_train.py --variants ktorch,ktorch_pageable --layers 8 --steps 1 --warmup 1 --profile \
  --jsonl "$OUT/profile.jsonl" "$@" 2>&1 | tee "$OUT/profile.log"
