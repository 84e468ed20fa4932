"""benchmarks/bench_train.py on the CPU with the tests' tiny shape: both variants build, take LoRA steps whose
adapters move, and report the same trainable parameter count (the same adapters on both sides)."""

from __future__ import annotations

import torch

from conftest import load_benchmark

bench = load_benchmark("bench_train")


def _run(variant: str) -> dict:
    args = bench.parse_args(["--shape", "tiny", "--device", "cpu", "--seq", "16", "--steps", "1", "--variant", variant])
    return bench.run_variant(args)


def test_both_variants_step_and_adapt_the_same_parameters():
    torch.manual_seed(0)
    rows = {v: _run(v) for v in bench.VARIANTS}
    for variant, row in rows.items():
        assert row["variant"] == variant and row["expert_lora"]
        assert row["step_s"] > 0 and len(row["steps"]) == 1
    assert rows["ktorch"]["trainable_params"] == rows["hf_offload"]["trainable_params"] > 0
