# End to end on the device (issues 4 and 5), Qwen3-30B-A3B shape: deferral d = 0 / 2 and 25% hot experts under
# CUDA graphs, profiled; then ktorch under CUDA graphs vs the accelerate offload baseline, profiled.
# (DEFERRED, GPU_EXPERTS, ZIPF, E2E_VARIANTS, SHAPE, DEFER_ARGS (more bench_deferral.py arguments, e.g.
# "--layers 12"; the d > 0 rows share one compile: --one-compile) and the *_TIMEOUT variables pick what runs.)
# JSON lines in $OUT/e2e.jsonl and $OUT/deferral.jsonl; each command is cut at its own time limit.
SHAPE=${SHAPE:-qwen3-30b-a3b}
cd benchmarks
timeout ${DEFER_TIMEOUT:-200} python3 bench_deferral.py speed --shape $SHAPE --variants cuda_graphs --deferred ${DEFERRED:-0,2} \
    --gpu-experts ${GPU_EXPERTS:-0.25} --zipf ${ZIPF:-1} --profile --one-compile --out "$OUT" --json "$OUT/deferral.jsonl" ${DEFER_ARGS:-} 2>&1 | grep -vE "^W1|Warning|warn"
timeout ${E2E_TIMEOUT:-300} python3 bench_e2e.py --shape $SHAPE --variants ${E2E_VARIANTS:-cuda_graphs,hf_offload} \
    --prompts 512 --decode-tokens 32 --repeats 2 --profile --out "$OUT" --json "$OUT/e2e.jsonl" 2>&1 | grep -vE "^W1|Warning|warn"
