# Second end-to-end pass (issues 4 and 5), Qwen3-30B-A3B shape: the accelerate offload baseline, then deferral
# d = 0 / 2 under CUDA graphs (routers not skewed), profiled.
cd benchmarks
timeout ${E2E_TIMEOUT:-120} python3 bench_e2e.py --shape qwen3-30b-a3b --variants hf_offload --prompts 512 \
    --decode-tokens 4 --json "$OUT/e2e.jsonl" 2>&1 | grep -vE "^W1|Warning|warn"
timeout ${DEFER_TIMEOUT:-400} python3 bench_deferral.py speed --shape qwen3-30b-a3b --variants cuda_graphs --deferred 0,2 \
    --gpu-experts "" --zipf 0 --profile --out "$OUT" --json "$OUT/deferral.jsonl" 2>&1 | grep -vE "^W1|Warning|warn"
