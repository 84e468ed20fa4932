#!/usr/bin/env bash
# Device check of GGUF loading on a Qwen3-30B-A3B-shaped random file: write it, load and generate with ktorch,
# and (if llama.cpp's llama-bench is on PATH) check llama.cpp accepts the same file.
#   bash benchmarks/gguf_device_run.sh Q4_0 [layers]      # Q8_0 (~32 GB), Q4_0 / Q4_K (~18 GB)
#   GGUF_LOG=FILE: the whole stderr (progress bars one update per line) appended there
#   GGUF_GENERATE_ARGS="--max-new-tokens 128 --deferred-experts 3" (later arguments win): more `ktorch generate` options
# Needs the gguf package (pip install gguf*.whl) and ktorch built in place (python setup.py build_ext --inplace).
set -euo pipefail
TYPE=${1:-Q4_0}
LAYERS=${2:-48}
FILE=${GGUF_DIR:-/tmp}/qwen3-30b-a3b-random-${TYPE}-${LAYERS}l.gguf
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
[ -f "$FILE" ] || python3 benchmarks/make_gguf.py --type "$TYPE" --layers "$LAYERS" --out "$FILE"
ls -l "$FILE"
/usr/bin/time -v python3 -m ktorch.cli generate --model "$FILE" --prompt "Hello, world" --max-new-tokens 32 ${GGUF_GENERATE_ARGS:-} \
  2> >(tr '\r' '\n' | tee -a "${GGUF_LOG:-/dev/null}" | grep --line-buffered -E "ktorch|prefill|Maximum resident|Elapsed|rror|layer/s\]$" >&2)
if command -v llama-bench >/dev/null; then llama-bench -m "$FILE" -p 64 -n 16 -ngl 0; fi
