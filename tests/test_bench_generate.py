"""benchmarks/bench_generate.py on the CPU: what a ``ktorch generate`` process prints parses back (the load time with
its prefill warm-up apart), and ``--breakdown`` times a process's first prefills by part, the parts adding up to the
prefill (tiny random GGUF)."""

from __future__ import annotations

import re

import pytest
import torch

from conftest import load_benchmark

bench = load_benchmark("bench_generate")


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    from ktorch.integrations.gguf_writer import write_random_qwen3moe_gguf

    return str(write_random_qwen3moe_gguf(
        tmp_path_factory.mktemp("gguf") / "t.gguf", experts_type="Q8_0", num_layers=2, num_experts=8,
        experts_per_token=2, hidden_size=64, expert_intermediate_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
        vocab_size=512, distinct_experts=2, progress=False))


def test_the_load_line_and_its_warm_up_parse_back(gguf, capsys, monkeypatch):
    """In process, ktorch.warm_up standing in for a GPU's (1.25 s): the printed loading line gives load_s (the total)
    and warmup_prefill_s; a fresh CPU process (no warm-up there) gives load_s and no warmup_prefill_s."""
    import ktorch
    from ktorch.cli import main

    monkeypatch.setattr(ktorch, "warm_up", lambda model: 1.25)
    assert main(["generate", "--model", gguf, "--device", "cpu", "--prompt", bench.prompt_of(40),
                 "--max-new-tokens", "3"]) == 0
    r = bench.parse_generate_output(capsys.readouterr().err)
    assert r["warmup_prefill_s"] == 1.25 and r["load_s"] >= 0 and r["prompt_tokens"] == 40
    monkeypatch.undo()
    r = bench.run_generate(gguf, 40, 3, ["--device", "cpu"], timeout_s=120)
    assert "error" not in r, r.get("error")
    assert r["prompt_tokens"] == 40 and r["first_token_s"] > 0 and r["load_s"] > 0 and "warmup_prefill_s" not in r


def test_breakdown_times_the_first_prefills_by_part(gguf, capsys):
    bench.main(["--gguf", gguf, "--breakdown", "2", "--prompts", "40", "--ktorch-args", "--device cpu"])
    out = capsys.readouterr().out
    assert re.search(r"loaded in [\d.]+ s on cpu \(prefill warm-up 0\.00 s\)", out), out  # none on the CPU
    first = re.search(r"P=40: first token s by run: ([\d.]+), ([\d.]+)", out)
    assert first, out
    rows = {m[1].strip(): m[2] for m in re.finditer(r"^    (\S.*?)\s{2,}(?:ms )?([\d., ]+)$", out, re.M)}
    for part in ("attention, layer 0", "routed experts, layer 0", "MoE block less experts, layers 1+",
                 "rest (embedding, norms, lm_head, sampling)", "minor page faults"):
        assert part in rows, out
    timed = [float(rows[p].split(",")[0]) for p in rows if p not in ("minor page faults",
                                                                    "CPU op (kt.fused_moe on the worker)")]
    assert sum(timed) == pytest.approx(1e3 * float(first[1]), rel=0.05, abs=0.5)  # the parts add up to the prefill
    assert len(rows["minor page faults"].split(",")) == 2  # per run


def test_prefill_profile_times_each_variant_and_profiles_one_prefill(gguf, capsys, tmp_path):
    """--prefill-profile (host- or GPU-bound prefill): a warm time and the first tokens per variant and length, then
    one profiled prefill each (on the CPU: no GPU time, no launches) with its most called ATen ops; the variants
    compute the same values, so give the same first token; --profile-trace writes the first variant's profiled
    prefill as a gzipped Chrome trace."""
    import gzip
    import json

    variants = ["default", "sync-per-layer", "rope kernel"]  # (on the CPU the rope kernel does not run: the same)
    bench.main(["--gguf", gguf, "--prefill-profile", "2", "--prompts", "70", "--ktorch-args", "--device cpu",
                "--prefill-variants", *variants, "--profile-trace", str(tmp_path / "t")])
    out = capsys.readouterr().out
    firsts = re.findall(r"\] (.+?)\s+P=70: first token [\d.]+ ms warm .* first tokens (\[\d+\])", out)
    assert [v for v, _ in firsts] == variants, out
    assert firsts[0][1] == firsts[1][1] == firsts[2][1]
    profiled = re.findall(r"\] (.+?)\s+P=70 profiled: wall [\d.]+ ms, GPU busy 0\.0 ms, 0 GPU kernels/copies, 0 "
                          r"launches, 0 synchronizing calls", out)
    assert profiled == variants, out
    counts = re.findall(r"most called ATen ops: (.+)", out)
    assert len(counts) == len(variants) and all(re.match(r"\w+ \d+", c) for c in counts), out
    traces = list(tmp_path.glob("t.*.P70.json.gz"))
    assert len(traces) == 1 and f"trace: {traces[0]}" in out, out
    events = json.load(gzip.open(traces[0]))["traceEvents"]
    assert any(e.get("name", "").startswith("aten::") for e in events)
