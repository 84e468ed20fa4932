# Prefill with experts streamed to the GPU (issue 7: "any mix of CPU AMX and GPU work that is fastest ... pick per
# length"). Qwen3-30B-A3B shape, int8 experts, eager forward (no compile per setting): no streaming, the calibrated
# plan ("auto"), and fixed shares around it, at 512 and 2048 prompt tokens. Then the best-known setting compiled
# under CUDA graphs. JSON lines in $OUT/prefill.jsonl. STREAM_SPECS / PREFILL_VARIANTS / PREFILL_PROMPTS override.
# First the host's limit on any split (bench_host_bandwidth.py: CPU reads and host-to-device copies, alone and at
# once; HOSTBW=0 skips it), PREFILL_CG_TIMEOUT=0 skips the CUDA-graph run; PREFILL_ARGS go to both bench_e2e runs
# (e.g. "--layers 12 --profile-prefill --out $OUT"), PREFILL_CG_STREAM is the CUDA-graph run's setting (auto).
cd benchmarks
if [ "${HOSTBW:-1}" != 0 ]; then
  timeout 120 python3 bench_host_bandwidth.py --threads ${HOSTBW_THREADS:-13 16} --json "$OUT/prefill.jsonl"
fi
timeout ${PREFILL_TIMEOUT:-330} python3 bench_e2e.py --shape ${SHAPE:-qwen3-30b-a3b} --variants eager \
    --prompts ${PREFILL_PROMPTS:-512,2048} --decode-tokens 0 --repeats 3 \
    --stream-experts "${STREAM_SPECS:-off;auto;512:0.25,2048:0.3;512:0.4,2048:0.45;512:0.55,2048:0.6}" \
    --json "$OUT/prefill.jsonl" ${PREFILL_ARGS:-} 2>&1 | grep -vE "^W1|Warning|warn"
[ "${PREFILL_CG_TIMEOUT:-240}" = 0 ] || timeout ${PREFILL_CG_TIMEOUT:-240} python3 bench_e2e.py --shape ${SHAPE:-qwen3-30b-a3b} --variants ${PREFILL_VARIANTS:-cuda_graphs} \
    --prompts ${PREFILL_PROMPTS:-512,2048} --decode-tokens 0 --repeats 3 --stream-experts "${PREFILL_CG_STREAM:-auto}" \
    --json "$OUT/prefill.jsonl" ${PREFILL_ARGS:-} 2>&1 | grep -vE "^W1|Warning|warn"
