"""KT_PROFILE=1: kt.fused_moe prints one line per call on stderr with its phase times and, for the two parallel
phases, where the workers' time went (<phase>.kernel / .epilogue (.scatter for down) / .other, means over
workers, and .busiest). The line is what benchmarks/bench_fused_moe.py --profile parses. Under a NUMA split
(KT_NUMA_SPLIT, e.g. forced over the whole suite on the device) each slice's op call prints its own line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_SCRIPT = """
import torch, ktorch
torch.manual_seed(int(__import__("sys").argv[1]))
E, K, H, I, T = 12, 3, 160, 96, 37
x = torch.randn(T, H, dtype=torch.bfloat16)
w13 = torch.randn(E, 2 * I, H, dtype=torch.bfloat16) * 0.05
w2 = torch.randn(E, H, I, dtype=torch.bfloat16) * 0.05
w, ids = torch.softmax(torch.randn(T, E), -1).topk(K, -1)
packed = ktorch.pack_experts(w13, w2, "{fmt}")
ktorch.fused_moe(x, ids, w.float(), packed)
split = packed._numa_split_cache
print("slices", 1 if split is None or split == "unsplittable" else split.num_slices)
"""


def parse(line: str) -> dict[str, float]:
    words = line.split(":", 1)[1].split()
    names = words[0::2]
    assert len(names) == len(set(names)), f"a phase named twice: {line}"
    return {name: float(value) for name, value in zip(names, words[1::2])}


@pytest.mark.parametrize("numa_split", ["", "2"], ids=["unsplit", "split2"])
@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_profile_line_breaks_the_parallel_phases_down_per_worker(fmt, numa_split, seed):
    """One entry a phase, whether the stages run in one pool dispatch (a plain call) or one each (a NUMA slice,
    whose h quantization between gate/up and down runs on its leader thread; KT_NUMA_SPLIT=2 forces a split on any
    machine), and none for a phase without tasks: bf16 weights read a bf16 input's rows in place, with no
    activations stage."""
    env = {**os.environ, "KT_PROFILE": "1", "KT_NUMA_SPLIT": numa_split}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT.replace("{fmt}", fmt), str(seed)], env=env,
                          capture_output=True, text=True, timeout=300, check=True)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("kt.fused_moe ")]
    slices = int(proc.stdout.split("slices", 1)[1])
    assert len(lines) == slices, (slices, proc.stderr)
    for line in lines:
        p = parse(line)
        for phase, epilogue in (("gate_up", "epilogue"), ("down", "scatter")):
            parts = [p[f"{phase}.{kind}"] for kind in ("kernel", epilogue, "other")]
            assert all(v >= 0 for v in parts), p
            assert p[f"{phase}.kernel"] > 0, p
            # a worker's time in the phase's tasks is at most the phase's wall time (slack: the line prints each value
            # rounded to 1 us, so three parts may sum 1.5 us above the busiest's rounded value, and clock reads);
            # down tasks may start before gate/up's wall time ends (the pipeline of expert groups), not before it
            window = p[phase] if phase == "gate_up" else p["gate_up"] + p["down"]
            assert sum(parts) <= p[f"{phase}.busiest"] + 2.5e-3 <= window + 0.05, p
        assert p["total"] >= p["gate_up"] + p["down"], p
        assert ("activations" in p) == (fmt != "bf16"), p
