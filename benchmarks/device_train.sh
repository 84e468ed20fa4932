#!/usr/bin/env bash
# Issue 35's device criterion, one call: the 48-layer Qwen3-30B-A3B shape (random weights), int8 experts frozen in
# host memory, LoRA r=8 on attention and on the experts, sequence 2048, batch 1: one training step through ktorch
# against transformers + accelerate with the experts offloaded by device_map (peft LoRA on attention; on the
# experts too it fails: see bench_train.py's hf_offload), the peak GPU memory of each.
#
# Wall-clock limit: 420 s (LIMIT=...; every stage is cut by `timeout` to what is left, the summary always prints).
# Run from the repo root on the device, ktorch built (editable), after the lead installed .whl/ (peft is needed and is
# not in the device image: carry .whl/peft-0.21.0-py3-none-any.whl, /opt/pypi/files/ here; this script installs it
# itself with --no-deps when `import peft` fails and the wheel is there). Logs and the JSON rows go to $OUT.
#
# Stages (each its own process, one after the other, so each has the host memory to itself):
#   1. ops          one layer's CPU calls at T=2048 (kt.fused_moe, kt.fused_moe_delta twice a step: forward and the
#                   checkpoint's recompute, kt.fused_moe_backward) side by side: the CPU experts' share of a step,
#                   48 layers; then each call's KT_PROFILE line (the backward's: decode, products, element-wise, copies)
#   2. ktorch x48   the criterion's model, 1 warm-up + 2 timed steps                                   (~30 s build)
#   3. hf x4, hf x8 the peer at 4 and 8 layers, 1 + 1 steps: its per-layer cost (b) and the rest (a), fitted as
#                   step(L) = a + b L and extrapolated to 48 layers, labelled as such
#   4. hf x48       the peer on the whole model, 0 warm-up + 1 timed step, only when >= 150 s are left (its bf16
#                   experts are 58 GB of host memory to build; a step copies them to the GPU twice: forward and
#                   the checkpoint's recompute)
#   5. extras while time is left: ktorch x48 without gradient checkpointing (no recompute: 2 CPU calls a layer
#                   instead of 3, every layer's activations kept on the GPU), ktorch x8 (beside hf x8)
# The table: step seconds, GPU peak GiB, hf / ktorch; the measured 48-layer peer when stage 5 ran, else the fit.
# Arguments are appended to every stage's bench_train.py call (argparse: the last wins), e.g. a smoke run here:
#   bash benchmarks/device_train.sh --shape tiny --device cpu --seq 32
set -u
EXTRA=("$@")
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
LIMIT=${LIMIT:-420}
START=$(date +%s)
ROWS="$OUT/train.jsonl"
: >"$ROWS"
left() { echo $((LIMIT - ($(date +%s) - START) - 12)); }  # 12 s kept for the summary

if ! python3 -c "import peft" 2>/dev/null; then
  wheel=$(ls .whl/peft-*.whl 2>/dev/null | head -1)
  if [ -n "$wheel" ]; then
    python3 -m pip install --no-deps --quiet --target /tmp/kt_peft "$wheel" >"$OUT/pip_peft.log" 2>&1 ||
      echo "pip install $wheel failed (see pip_peft.log)"
    export PYTHONPATH=/tmp/kt_peft${PYTHONPATH:+:$PYTHONPATH}
  fi
fi
python3 -c "import peft, accelerate; print('peft', peft.__version__, 'accelerate', accelerate.__version__)" ||
  echo "peft/accelerate missing: the model stages will fail (carry .whl/peft-*.whl)"
python3 -c "import torch, ktorch; print('torch', torch.__version__, 'gpu', torch.cuda.get_device_name(), 'kernel', ktorch.cpu_features()['kernel'])"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
free -g | head -2

# stage NAME MAX_S ARGS...: bench_train.py with ARGS, cut at min(MAX_S, what is left); skipped under 20 s left
stage() {
  local name=$1 max=$2
  shift 2
  local budget
  budget=$(left)
  [ "$budget" -gt "$max" ] && budget=$max
  if [ "$budget" -lt 20 ]; then
    echo "== $name: skipped, $(left) s left"
    return
  fi
  echo "== $name (limit ${budget} s): bench_train.py $*"
  local t0=$(date +%s)
  timeout -k 5 "$budget" python3 benchmarks/bench_train.py --jsonl "$ROWS" "$@" "${EXTRA[@]}" >"$OUT/$name.log" 2>&1
  local rc=$?
  grep -v "^machine:" "$OUT/$name.log" | tail -8
  echo "   ($name: rc $rc, $(($(date +%s) - t0)) s wall)"
  [ $rc -eq 124 ] && echo "{\"variant\": \"$name\", \"error\": \"cut by the ${budget} s limit\"}" >>"$ROWS"
}

stage ops 60 --variants ops --seq 2048 --experts-dtype int8 --profile
stage ktorch48 150 --variants ktorch --seq 2048 --experts-dtype int8 --steps 2 --warmup 1
stage hf4 60 --variants hf_offload --seq 2048 --layers 4 --steps 1 --warmup 1
stage hf8 80 --variants hf_offload --seq 2048 --layers 8 --steps 1 --warmup 1
if [ "$(left)" -ge 150 ]; then
  stage hf48 "$(left)" --variants hf_offload --seq 2048 --steps 1 --warmup 0
else
  echo "== hf48: skipped, $(left) s left (< 150 s); the 48-layer peer is the fit of hf4/hf8"
fi
if [ "$(left)" -ge 100 ]; then  # extras, as time allows: ktorch without the checkpoint's recompute; 8 layers
  stage ktorch48_nockpt 120 --variants ktorch --seq 2048 --experts-dtype int8 --steps 1 --warmup 1 --checkpointing off
fi
if [ "$(left)" -ge 45 ]; then
  stage ktorch8 60 --variants ktorch --seq 2048 --experts-dtype int8 --layers 8 --steps 2 --warmup 1
fi

python3 - "$ROWS" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
ok = [r for r in rows if "error" not in r]
for r in rows:
    if "error" in r:
        print(f"failed or cut: {r['variant']}: {r['error']}")
ops = next((r for r in ok if r["variant"] == "ops"), None)
if ops:
    print(f"one layer, int8, T={ops['seq']}, ms a call: {ops['ms']}")
    print(f"CPU experts a step, {ops['layers']} layers (fused_moe_delta + fused_moe_backward a layer): "
          f"{ops['cpu_step_s']:.2f} s with expert LoRA; without it (fused_moe + plain backward): "
          f"{ops['cpu_step_s_no_expert_lora']:.2f} s")
full = ops["layers"] if ops else 48  # the shape's own layer count (48 for Qwen3-30B-A3B)
def pick(variant, layers, ckpt="on"):
    return next((r for r in ok if r["variant"] == variant and r["layers"] == layers
                 and r.get("checkpointing", "on") == ckpt), None)
kt48, kt8, hf4, hf8, hf48 = pick("ktorch", full), pick("ktorch", 8), pick("hf_offload", 4), pick("hf_offload", 8), pick("hf_offload", full)
kt48_nockpt = pick("ktorch", full, "off")
fit = None
if hf4 and hf8:
    b = (hf8["step_s"] - hf4["step_s"]) / 4
    a = hf4["step_s"] - 4 * b
    fit = a + full * b
    print(f"hf_offload fit: step(L) = {a:.2f} + {b:.3f} L s -> {fit:.2f} s at {full} layers (EXTRAPOLATED from 4 and 8 layers)")
print(f"{'model':<34} {'step s':>8} {'GPU peak GiB':>13} {'host peak GiB':>14} {'hf / ktorch':>12}")
def line(label, r, step=None, ratio_to=None):
    step = r["step_s"] if r else step
    gpu = f"{r['gpu_peak_gib']:.2f}" if r and r.get("gpu_peak_gib") is not None else "-"
    host = f"{r['host_peak_gib']:.1f}" if r else "-"
    ratio = f"{step / ratio_to:.2f}x" if ratio_to and step else ""
    print(f"{label:<34} {step if step is not None else float('nan'):>8.2f} {gpu:>13} {host:>14} {ratio:>12}")
for label, r in (("ktorch, 8 layers", kt8), ("hf_offload, 4 layers", hf4), ("hf_offload, 8 layers", hf8)):
    if r:
        line(label, r, ratio_to=kt8["step_s"] if kt8 and r["variant"] == "hf_offload" and r["layers"] == 8 else None)
if kt48_nockpt:
    line(f"ktorch, {full} layers, no checkpointing", kt48_nockpt)
if kt48:
    line(f"ktorch, {full} layers", kt48)
    if hf48:
        line(f"hf_offload, {full} (measured, no warm-up)", hf48, ratio_to=kt48["step_s"])
    if fit:
        line(f"hf_offload, {full} layers (EXTRAPOLATED)", None, step=fit, ratio_to=kt48["step_s"])
    gpu = kt48["gpu_peak_gib"]
    print("criterion: >= 10x faster and GPU < 24 GB: ktorch GPU peak "
          + (f"{gpu:.2f} GiB ({gpu * 2**30 / 1e9:.2f} GB)" if gpu is not None else "- (no GPU)")
          + f", steps {kt48['steps']}")
machine = next((r["machine"] for r in ok if "machine" in r), {})
print(f"machine: {machine}")
EOF
echo "device_train.sh: $(($(date +%s) - START)) s"
