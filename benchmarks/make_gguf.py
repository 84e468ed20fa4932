"""Writes a random Qwen3-30B-A3B-shaped qwen3moe GGUF for speed benchmarks (llama-bench, ktorch generate).

    python benchmarks/make_gguf.py --type Q8_0 --out /tmp/qwen3-30b-a3b-random-q8_0.gguf
    python benchmarks/make_gguf.py --type Q4_K --layers 4 --out /tmp/small.gguf     # a quick 4-layer file

48 layers, 128 experts (top-8), H=2048, expert I=768, 32 query / 4 KV heads of 128, vocabulary 151936, no
tokenizer (tokenizer.ggml.model = "none"); experts in --type (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, BF16, F16), the other
matrices F16, norms and router F32. Each layer's experts repeat --distinct random experts, so writing is fast and
memory stays at one tensor (about 0.2 GB for Q8_0), while every expert has its own bytes in the file.
File sizes at 48 layers: Q8_0 about 32 GB, Q4_K/Q4_0 about 18 GB.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ktorch.integrations.gguf_writer import write_random_qwen3moe_gguf  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the .gguf file to write")
    p.add_argument("--type", default="Q8_0", choices=["Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "BF16", "F16"],
                   help="GGML type of the routed experts (default: Q8_0)")
    p.add_argument("--layers", type=int, default=48, help="decoder layers (default: 48)")
    p.add_argument("--experts", type=int, default=128, help="routed experts per layer (default: 128)")
    p.add_argument("--top-k", type=int, default=8, help="experts per token (default: 8)")
    p.add_argument("--distinct", type=int, default=4, help="distinct random experts repeated across a layer (default: 4)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    args = p.parse_args()
    t0 = time.perf_counter()
    path = write_random_qwen3moe_gguf(Path(args.out), experts_type=args.type, num_layers=args.layers,
                                      num_experts=args.experts, experts_per_token=args.top_k,
                                      distinct_experts=args.distinct, seed=args.seed)
    size = path.stat().st_size
    print(f"wrote {path}: {size / 1e9:.2f} GB, {args.layers} layers, {args.type} experts, "
          f"in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
