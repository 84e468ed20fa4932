#!/usr/bin/env bash
# Device check of branch exp-sdpa (ktorch/generation.py `prefill_attention`: eager prefills and serve's eager steps
# run SDPA without cuDNN attention, whose plans torch builds per new shape). ONE call, limit 300 s (H100/H200 host):
#   1. the machine's SDPA facts: cuDNN version, and one masked SDPA call (Qwen3-30B-A3B attention: 32 query heads,
#      4 KV heads, head dim 128, bf16, a static cache's boolean mask) at five new (query, key) shapes: first and
#      second call ms, torch's default order against `prefill_attention()`.
#   2. a random 12-layer Q8_0 file; `bench_generate.py --breakdown 2` (one process, after the load warm-up) at
#      P = 512, 700, 1000, 2048, with the branch's prefill_attention and with it replaced by a no-op (torch's order):
#      each length's first and second prefill by part. Done when a new length's first prefill is within a few ms of
#      its second with the branch, and the warm prefill is no slower than torch's order.
#   bash benchmarks/device_sdpa.sh          # from the repo root, ktorch built, .whl installed (gguf)
set -uo pipefail
OUT=${OUT:-/tmp/device_sdpa_out}
mkdir -p "$OUT"
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
START=$(date +%s)
echo "== 1. SDPA with a mask at new shapes (limit 60 s)"
timeout 60 python3 - <<'PY' 2>&1 | tee "$OUT/probe.log"
import time, torch, torch.nn.functional as F
from ktorch.generation import prefill_attention
print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version(), torch.cuda.get_device_name())
def run(q_len, kv_len, ctx):
    q = torch.randn(1, 32, q_len, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 32, kv_len, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    mask = torch.ones(q_len, kv_len, device="cuda", dtype=torch.bool).tril(kv_len - q_len)[None, None]
    times = []
    for _ in range(2):
        torch.cuda.synchronize(); t0 = time.perf_counter()
        with ctx():
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        torch.cuda.synchronize(); times.append(1e3 * (time.perf_counter() - t0))
    return times
import contextlib
for name, ctx in (("torch's order", contextlib.nullcontext), ("prefill_attention", prefill_attention)):
    for q_len, kv_len in ((512, 768), (700, 1024), (1000, 1280), (2048, 2304), (333, 512)):
        a, b = run(q_len + (name != "torch's order"), kv_len, ctx)  # other shapes for the second setting
        print(f"  {name:18s} q {q_len:5d} kv {kv_len:5d}: first {a:8.2f} ms, second {b:7.3f} ms")
PY
echo "   ($(($(date +%s) - START)) s)"
FILE=/tmp/q8-12l.gguf
echo "== 2. generate prefills by part, P = 512 700 1000 2048 (limit $((290 - ($(date +%s) - START))) s)"
[ -f "$FILE" ] || timeout 90 python3 benchmarks/bench_generate.py --gguf "$FILE" --write-layers 12 --write-type Q8_0 \
  --skip-ktorch 2>&1 | grep -E "wrote" | sed 's/^/   /'
ARGS=(--gguf "$FILE" --prompts 512 700 1000 2048 --breakdown 2 --prompt-kind random --ktorch-args "")
for variant in branch torch; do
  left=$((290 - ($(date +%s) - START)))
  if [ "$left" -lt 50 ]; then echo "   [$variant] skipped: $left s left"; continue; fi
  if [ "$variant" = branch ]; then
    timeout $((left - 5)) python3 benchmarks/bench_generate.py "${ARGS[@]}" > "$OUT/breakdown_$variant.log" 2>&1
  else
    timeout $((left - 5)) python3 -c "
import contextlib, runpy, sys
import ktorch.generation as g
g.prefill_attention = contextlib.nullcontext  # torch's own SDPA order (cuDNN first on sm90 with cuDNN >= 9.15)
sys.argv = ['bench_generate.py'] + sys.argv[1:]
runpy.run_path('benchmarks/bench_generate.py', run_name='__main__')" "${ARGS[@]}" > "$OUT/breakdown_$variant.log" 2>&1
  fi
  echo "   [$variant] rc $?"
  grep -E "first token s by run|attention, layer 0|routed experts, layer 0|new CUDA segments" "$OUT/breakdown_$variant.log" | sed 's/^/     /'
done
echo "done in $(($(date +%s) - START)) s; logs under $OUT"
