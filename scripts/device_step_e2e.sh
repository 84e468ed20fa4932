# End to end on the device (issues 4 and 5), Qwen3-30B-A3B shape: ktorch under CUDA graphs vs the accelerate
# offload baseline, profiled; then deferral d = 0 / 2 and 25% hot experts under CUDA graphs, profiled.
# JSON lines in $OUT/e2e.jsonl and $OUT/deferral.jsonl; each command is cut at its own time limit.
python3 -m pip install -q --no-deps --no-index --target /tmp/site .whl/accelerate-*.whl .whl/psutil-*.whl 2>/dev/null
SHAPE=${SHAPE:-qwen3-30b-a3b}
cd benchmarks
timeout ${E2E_TIMEOUT:-250} python3 bench_e2e.py --shape $SHAPE --variants ${E2E_VARIANTS:-cuda_graphs,hf_offload} \
    --prompts 512 --decode-tokens 32 --repeats 2 --profile --out "$OUT" --json "$OUT/e2e.jsonl" 2>&1 | grep -vE "^W1|Warning|warn"
timeout ${DEFER_TIMEOUT:-290} python3 bench_deferral.py speed --shape $SHAPE --variants cuda_graphs --deferred 0,2 \
    --gpu-experts ${GPU_EXPERTS:-0.25} --profile --out "$OUT" --json "$OUT/deferral.jsonl" 2>&1 | grep -vE "^W1|Warning|warn"
