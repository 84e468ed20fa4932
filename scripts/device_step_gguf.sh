# Issue 6 on the device: a random Qwen3-30B-A3B-shaped GGUF (48 layers, GGUF_TYPE experts, default Q4_K) written
# by benchmarks/make_gguf.py, then `ktorch generate` on it (experts on the CPU, the rest on the GPU): load time,
# peak RSS (/usr/bin/time -v) and prefill/decode tokens/s, compiled (static cache + CUDA graphs; GGUF_RUNS="eager --compile" adds eager first).
# Needs the gguf wheel (device_check.sh installs .whl). GGUF_TYPE, GGUF_LAYERS, GGUF_NEW_TOKENS, GGUF_RUNS override.
set -uo pipefail
TYPE=${GGUF_TYPE:-Q4_K}
LAYERS=${GGUF_LAYERS:-48}
export GGUF_DIR=${GGUF_DIR:-/tmp}
FILE=$GGUF_DIR/qwen3-30b-a3b-random-${TYPE}-${LAYERS}l.gguf
[ -f "$FILE" ] || timeout ${GGUF_WRITE_TIMEOUT:-240} python3 benchmarks/make_gguf.py --type "$TYPE" --layers "$LAYERS" \
    --out "$FILE" 2>&1 | grep -v "writing "
for args in ${GGUF_RUNS:---compile}; do
  [ "$args" = eager ] && args=""
  echo "--- ktorch generate ${args:-(eager)}"
  GGUF_GENERATE_ARGS="--max-new-tokens ${GGUF_NEW_TOKENS:-64} $args" GGUF_LOG=${GGUF_LOG:-${OUT:-/tmp}/gguf_stderr.log} \
      timeout ${GGUF_TIMEOUT:-420} bash benchmarks/gguf_device_run.sh "$TYPE" "$LAYERS"
done
