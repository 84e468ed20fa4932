"""benchmarks/bench_train.py on the CPU with the tests' tiny shape: both variants build, take LoRA steps whose
adapters move, and report the same trainable parameter count (the same adapters on both sides)."""

from __future__ import annotations

import torch

from conftest import load_benchmark

bench = load_benchmark("bench_train")


def _run(variant: str, *extra: str) -> dict:
    args = bench.parse_args(["--shape", "tiny", "--device", "cpu", "--seq", "16", "--steps", "1", "--variant", variant,
                             *extra])
    return bench.run_variant(args)


def test_both_variants_step_and_adapt_the_same_parameters():
    torch.manual_seed(0)
    # the peer's expert adapters: on the CPU (no accelerate offload) peft's target_parameters work
    rows = {v: _run(v, "--hf-expert-lora", "on") for v in bench.VARIANTS}
    for variant, row in rows.items():
        assert row["variant"] == variant and row["expert_lora"]
        assert row["step_s"] > 0 and len(row["steps"]) == 1
    assert rows["ktorch"]["trainable_params"] == rows["hf_offload"]["trainable_params"] > 0
    plain = _run("hf_offload")  # the default: attention adapters only (see bench_train's hf_offload)
    assert not plain["expert_lora"] and 0 < plain["trainable_params"] < rows["hf_offload"]["trainable_params"]


def test_ops_variant_times_the_three_cpu_calls_of_a_trained_layer():
    args = bench.parse_args(["--shape", "tiny", "--seq", "16", "--op-reps", "1", "--variant", "ops"])
    row = bench.run_variant(args)
    assert set(row["ms"]) == {"fused_moe", "fused_moe_delta", "fused_moe_backward", "fused_moe_backward_plain"}
    assert all(v > 0 for v in row["ms"].values())
    # one delta call (the forward; the checkpoint's recompute keeps its outputs) and one backward a layer
    expected = row["layers"] * (row["ms"]["fused_moe_delta"] + row["ms"]["fused_moe_backward"]) / 1e3
    assert abs(row["cpu_step_s"] - expected) <= row["layers"] * 2 * 0.005e-3 + 1e-9  # ms rounded to 0.01


def test_ops_variant_with_its_own_layer_shape_and_the_recompute_row():
    args = bench.parse_args(["--shape", "tiny", "--seq", "16", "--op-reps", "1", "--variant", "ops", "--op-shape",
                             "6,64,32,3", "--recompute-row", "--op-dtype", "float32", "--layout-row"])
    row = bench.run_variant(args)
    assert row["dims"] == dict(E=6, H=64, I=32, K=3) and row["op_dtype"] == "float32"
    assert set(row["ms"]) == {"fused_moe", "fused_moe_delta", "fused_moe_backward", "fused_moe_backward_plain",
                              "fused_moe_backward_recompute"}
    assert all(v > 0 for v in row["ms"].values())
    layout = row["layout_ms"]  # the backward's products in both weight layouts, at the layer's mean rows an expert
    assert layout.pop("n") == 16 * 3 // 6 and set(layout) == {"dY_W2_rows", "dY_W2_transposed", "dgu_W13_rows",
                                                              "dgu_W13_transposed"}
    assert all(v > 0 for v in layout.values())


def test_pageable_variant_steps_with_fp32_deltas_and_plain_copies(monkeypatch):
    """ktorch_pageable (the crossings before ktorch/ops/host_transfer.py) steps like ktorch; in its process the
    copies are plain .to() and bf16 deltas cross in fp32 (restored after the test: the variant patches modules)."""
    import ktorch.lora
    import ktorch.ops.host_transfer as ht

    for mod, name in ((ht, "host_copies"), (ht, "device_copy"), (ktorch.lora, "to_host")):
        monkeypatch.setattr(mod, name, getattr(mod, name))  # restored at teardown
    row = _run("ktorch_pageable")
    assert row["variant"] == "ktorch_pageable" and row["expert_lora"] and row["step_s"] > 0
    seen = []
    copies = ht.host_copies
    monkeypatch.setattr(ht, "host_copies", lambda ts: seen.append([t.dtype for t in ts]) or copies(ts))
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    ids = torch.zeros(3, 2, dtype=torch.long)
    out = ktorch.lora.to_host(x, ids, x[:, :2], torch.ones(3, 2, 5, dtype=torch.bfloat16))
    assert seen == [[torch.bfloat16, torch.long, torch.bfloat16, torch.float32]] and out[3].dtype == torch.float32
