# Issue 7: ktorch against llama.cpp on one random Qwen3-30B-A3B-shaped GGUF per experts type
# (benchmarks/bench_vs_llamacpp.py). Run through device_check.sh, which builds ktorch and installs .whl (gguf):
#   VS_TYPES=Q8_0 bash scripts/device_check.sh vs_llamacpp        # carry .whl; then VS_TYPES=Q4_0
# Needs llama-bench from scripts/device_step_llamacpp_build.sh (/tmp/lcpp, the same warm machine); without it the
# llama.cpp columns stay empty. VS_TYPES (default Q8_0), VS_LAYERS (default 12), VS_ARGS (more arguments, e.g.
# "--skip-ktorch --keep"), VS_STREAM (ktorch prefill streaming settings, default auto; "off;auto" times both), VS_TIMEOUT (default 480 s: the bench is stopped before the call's 600 s, deleting its
# file). Results accumulate across calls in /tmp/vs_llamacpp.jsonl, copied to $OUT with the table of all so far.
set -uo pipefail
OUT=${OUT:-/tmp/out}
J=/tmp/vs_llamacpp.jsonl
[ -x /tmp/lcpp/bin/llama-bench ] || echo "no /tmp/lcpp/bin/llama-bench: run scripts/device_step_llamacpp_build.sh first"
# shellcheck disable=SC2086  # VS_ARGS is a list of arguments
timeout "${VS_TIMEOUT:-480}" python3 benchmarks/bench_vs_llamacpp.py --types "${VS_TYPES:-Q8_0}" \
  --layers "${VS_LAYERS:-12}" --stream-experts "${VS_STREAM:-auto}" --json "$J" --out "$OUT" ${VS_ARGS:-}
echo "exit $?"
echo "== every result in $J so far"
python3 benchmarks/bench_vs_llamacpp.py --report "$J"
cp "$J" "$OUT/"
