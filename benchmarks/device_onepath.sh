#!/usr/bin/env bash
# Issue 31 item 1 on the device: every end-to-end benchmark's decode figure against what `ktorch generate` prints
# for the same settings (done when within 5%). Wall-clock limit: 540 s (run it with timeout_s=570; typically
# ~6 minutes, each command has its own timeout so a stuck one leaves time for the rest).
#   bash benchmarks/device_onepath.sh
# On one random 12-layer Qwen3-30B-A3B-shaped Q8_0 GGUF (~8 GB, written once, reused by every step):
#   1. `ktorch generate` typed directly, defaults and --deferred-experts 3 (the reference figures)
#   2. bench_vs_llamacpp.py --skip-llamacpp (its ktorch side), the same two settings
#   3. bench_e2e.py --variants ktorch,hf_offload --layers 12 (the offload peer at 12 layers too)
#   4. bench_deferral.py speed --deferred 0,3 --gpu-experts 0.25 (the CLI's loader and call in-process)
# Prints each decode figure and its ratio to step 1's; logs and JSON lines under $OUT.
# Needs .whl (gguf, accelerate) installed and ktorch built (editable) before it starts.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
FILE=/tmp/qwen3-30b-a3b-random-Q8_0-12l.gguf   # the name bench_vs_llamacpp.py and bench_e2e.py look for
PROMPT=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from bench_generate import prompt_of; print(prompt_of(512))")
START=$(date +%s)
stamp() { echo "== $(( $(date +%s) - START )) s: $*"; }

stamp "write $FILE"
[ -f "$FILE" ] || timeout 120 python3 benchmarks/make_gguf.py --type Q8_0 --layers 12 --out "$FILE" 2>&1 | tail -1

for opts in "" "--deferred-experts 3"; do
  for run in 1 2; do
    stamp "ktorch generate --model FILE --prompt <512 bytes> --max-new-tokens 64 $opts (run $run)"
    timeout 90 ktorch generate --model "$FILE" --prompt "$PROMPT" --max-new-tokens 64 $opts >/dev/null 2>"$OUT/run.err"
    grep -E "^prefill|loaded in|capture" "$OUT/run.err"
    cat "$OUT/run.err" >> "$OUT/direct.log"
    echo "-- end of run [$opts] $run" >> "$OUT/direct.log"
  done
done

stamp "bench_vs_llamacpp.py --skip-llamacpp"
timeout 150 python3 benchmarks/bench_vs_llamacpp.py --types Q8_0 --layers 12 --prompts 512 --gen 64 --runs 2 \
  --skip-llamacpp --keep --ktorch-args "" "--deferred-experts 3" --json "$OUT/vs.jsonl" --out "$OUT" \
  > "$OUT/vs.log" 2>&1; tail -6 "$OUT/vs.log"

stamp "bench_e2e.py --layers 12"
timeout 150 python3 benchmarks/bench_e2e.py --shape qwen3-30b-a3b --layers 12 --prompts 512 --decode-tokens 64 \
  --runs 1 --keep --ktorch-args "" "--deferred-experts 3" --json "$OUT/e2e.jsonl" > "$OUT/e2e.log" 2>&1
tail -8 "$OUT/e2e.log"

stamp "bench_deferral.py speed --layers 12"
timeout 120 python3 benchmarks/bench_deferral.py speed --layers 12 --keep --deferred 0,3 --gpu-experts 0.25 \
  --decode-tokens 64 --profile-steps 10 --json "$OUT/deferral.jsonl" > "$OUT/deferral.log" 2>&1
tail -12 "$OUT/deferral.log"

stamp "compare"
python3 - "$OUT" <<'EOF'
import json, re, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
direct = {}
# direct.log: each run's stderr, then "-- end of run [OPTS] N"
text = (out / "direct.log").read_text()
for body, opts in re.findall(r"(.*?)-- end of run \[(.*?)\] \d\n", text, re.S):
    m = re.search(r"decode: \d+ tokens in [\d.]+ s \(([\d.]+) tok/s\)", body)
    if m:
        direct.setdefault(opts.strip() or "defaults", []).append(float(m[1]))
ref = {k: statistics.median(v) for k, v in direct.items()}
print("ktorch generate typed directly, decode tok/s:", {k: v for k, v in direct.items()})

def read(name):
    p = out / name
    return [json.loads(l) for l in p.read_text().splitlines() if l.strip()] if p.exists() else []

def show(label, opts, value):
    r = ref.get(opts)
    ratio = f"{value / r:.3f} of direct ({'within' if r and abs(value / r - 1) <= 0.05 else 'OUTSIDE'} 5%)" if r else "no direct figure"
    print(f"{label} [{opts}]: decode {value:.1f} tok/s, {ratio}")

for l in read("vs.jsonl"):
    if l.get("kind") == "ktorch" and "tg64" in l.get("tests", {}):
        show("bench_vs_llamacpp", l["variant"], l["tests"]["tg64"])
for l in read("e2e.jsonl"):
    if l.get("decode_tok_s"):
        if l["variant"] == "ktorch":
            show("bench_e2e ktorch", l["options"], l["decode_tok_s"])
        else:
            print(f"bench_e2e hf_offload (12 layers): prefill {l['prefill_tok_s']:.1f} tok/s, decode {l['decode_tok_s']:.3f} tok/s")
for l in read("deferral.jsonl"):
    if l["gpu_experts"] == 0:
        show("bench_deferral speed (Zipf-skewed routers)", "defaults" if l["n_deferred_experts"] == 0 else f"--deferred-experts {l['n_deferred_experts']}", l["decode_tok_s"])
    else:
        print(f"bench_deferral speed: {100 * l['gpu_experts']:.0f}% hot experts on the GPU (f={l['f']:.2f}): decode {l['decode_tok_s']:.1f} tok/s")
EOF
stamp "done"
