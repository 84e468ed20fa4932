# End to end on the Qwen3-30B-A3B shape (issue 4): ktorch eager / compiled / CUDA graphs, then the accelerate
# offload baseline; results appended to $OUT/e2e.jsonl (the table goes to the step log).
python3 -m pip install -q --no-deps --no-index --target /tmp/site .whl/accelerate-*.whl .whl/psutil-*.whl 2>/dev/null
python3 benchmarks/bench_e2e.py --shape qwen3-30b-a3b --variants eager,compiled,cuda_graphs --prompts 512,2048 \
    --decode-tokens 32 --repeats 2 --json "$OUT/e2e.jsonl"
