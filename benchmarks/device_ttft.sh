#!/usr/bin/env bash
# Device check of the load-time warm-up (ktorch.warm_up: one prefill of 2048 random ids at the end of loading, so the
# first prompt runs at warm speed; docs/architecture.md section 7, step 0). Wall-clock limit: 300 s (each step has its
# own timeout; typically ~4 minutes).
#
#   bash benchmarks/device_ttft.sh        # from the repo root
#
# 1. the CUDA tests of the change: after ktorch.warm_up the first prompt's prefill makes no new CUDA segment and no
#    new pinned staging, with the tokens of a model without the warm-up (split and CPU-op-only models);
# 2. a random 12-layer Qwen3-30B-A3B-shaped Q8_0 file (bench_generate.py --write-layers 12, ~8 GB, about a minute),
#    then fresh `ktorch generate` processes, defaults, P=512 and P=2048 (one process each): per process the load
#    time with the warm-up in it, the warm-up's seconds and the first prompt's first-token time, as generate prints
#    them. Before the warm-up (2026-11-26 morning, H200 host, same file) a fresh process's first token took 0.47 s at
#    P=512 and 0.54 s at P=2048, against 0.08 / 0.11 s warm: the first-token figures here should be near the warm ones;
# 3. bench_generate.py --breakdown 2 (one process loaded as generate loads, the warm-up included): the first two
#    prompts of P=512 then 2048 by part (attention, router/shared, routed experts, the CPU op on its worker, the rest)
#    with page faults and new CUDA segments; run 0 (the first prompt after the warm-up) should match run 1.
set -uo pipefail
OUT=${OUT:-/tmp/device_ttft_out}
mkdir -p "$OUT"
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
FILE=/tmp/q8-12l-ttft.gguf
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
lscpu | grep -E "Model name|^CPU\(s\)" | tr -s ' '
python3 -c "import torch, ktorch; print('torch', torch.__version__, 'ktorch', ktorch.__file__, ktorch.cpu_features())" 2>&1 | tail -1

echo "=== CUDA tests of the change ($(date +%T))"
timeout 60 python3 -m pytest -q -x tests/test_routed_experts.py -k "cuda_warm_up" 2>&1 | tail -3

echo "=== fresh ktorch generate processes, defaults ($(date +%T))"
timeout 165 python3 benchmarks/bench_generate.py --gguf "$FILE" --write-layers 12 --write-type Q8_0 --runs 1 \
  --prompts 512 2048 --gen 8 --prompt-kind random --timeout 80 --json "$OUT/ttft.jsonl" 2>&1 | tee "$OUT/ttft.log" \
  | grep -vE "^\s*\{" | grep -E "P=|rror|wrote|Traceback" || true
python3 - "$OUT/ttft.jsonl" <<'PY' || true
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("kind") == "ktorch" and "error" not in r:
        print(f"P={r['prompt']}: load {r['load_s']:.1f} s, of it prefill warm-up {r.get('warmup_prefill_s', float('nan')):.2f} s; "
              f"first token {r['first_token_s']:.3f} s ({r['prefill_tok_s']:.0f} tok/s)")
PY

echo "=== the first prompts after the warm-up by part, one process ($(date +%T))"
timeout 65 python3 benchmarks/bench_generate.py --gguf "$FILE" --breakdown 2 --prompts 512 2048 --prompt-kind random \
  --ktorch-args "" 2>&1 | tee "$OUT/breakdown.log" | grep -E "breakdown|^    |rror|Traceback" || true
rm -f "$FILE"
echo "done $(date +%T); logs in $OUT (ttft.log, ttft.jsonl, breakdown.log)"
