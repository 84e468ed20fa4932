#!/usr/bin/env bash
# Device check of `--gpu-memory auto` as the default (issues 31, 36), from the repo root on the GPU host, limit 150 s
# of wall clock (needs transformers >= 5.24: the lead's .whl/ first). Runs the CUDA tests of what the change touched
# and prints pytest's summary of each stage; logs under $OUT:
#   one pytest process (limit: what is left of 150 s), -v so that a cut run still shows each finished test:
#   tests/test_routed_experts.py, test_cuda_prepare_and_load_default_to_resident_experts and test_cuda_split_prefill_*:
#      prepare/ktorch.load default to residents on a GPU (logits match HF eager, decode hits residents only), "off"
#      holds none, trainable takes them back; the split with "off" and with a 2GiB budget.
#   tests/test_serve_cuda.py: graphed serve steps equal eager ones with every expert on the CPU op (--gpu-memory off)
#      and with the default residents (no CPU experts call, /v1/stats hit rate 1.0); `ktorch serve` reserves its KV
#      pool before the residents (--kv-pages 512: the plan's reserve is the pool's bytes, transformers allocates it
#      with max_memory_percent 1.0 and serves; default: the pool grown by what the residents leave).
# Prints the GPU, each test's PASSED/FAILED line, the failures' first lines and pytest's summary (or TIMEOUT).
set -uo pipefail
LIMIT=${LIMIT:-150}
T0=$(date +%s)
OUT=${OUT:-/tmp/device_gpuauto_out}
mkdir -p "$OUT"
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader | tee "$OUT/gpu.txt"

left=$((LIMIT - ($(date +%s) - T0) - 5))
timeout "$left" python -m pytest -v -p no:cacheprovider \
  tests/test_routed_experts.py::test_cuda_prepare_and_load_default_to_resident_experts \
  tests/test_routed_experts.py::test_cuda_split_prefill_matches_hf_eager_and_pins_every_expert \
  tests/test_serve_cuda.py > "$OUT/pytest.log" 2>&1
rc=$?
grep -E "(PASSED|FAILED|ERROR|SKIPPED)( |$)" "$OUT/pytest.log" | grep "::" | sed 's/ *\[ *[0-9]*%\]//'
grep -E "^E  " "$OUT/pytest.log" | head -20
if ((rc == 124)); then echo "TIMEOUT after ${left} s"; else echo "pytest rc $rc: $(tail -1 "$OUT/pytest.log")"; fi
echo "total $(($(date +%s) - T0)) s"
