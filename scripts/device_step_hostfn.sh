# Python vs native (C, no GIL) CUDA host functions around the CPU experts under CUDA graphs (issue 4): DeepSeek-V2-Lite
# decode and its step profile (do the shared experts now overlap the CPU call?), then Qwen3-30B-A3B decode.
cd benchmarks
for hf in python native; do
  KT_HOST_FUNCTIONS=$hf timeout 170 python3 bench_e2e.py --shape deepseek-v2-lite --variants cuda_graphs --prompts 512 \
      --decode-tokens 32 --repeats 1 --profile --out "$OUT/$hf" --json "$OUT/hostfn.jsonl" 2>&1 | grep -E "^\||^profile|between"
done
KT_HOST_FUNCTIONS=native timeout 220 python3 bench_e2e.py --shape qwen3-30b-a3b --variants cuda_graphs --prompts 512 \
    --decode-tokens 32 --repeats 1 --profile --out "$OUT/native" --json "$OUT/hostfn.jsonl" 2>&1 | grep -E "^\||^profile"
