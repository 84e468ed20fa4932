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

    monkeypatch.setattr(ktorch, "warm_up", lambda model, capture=True: 1.25)
    assert main(["generate", "--model", gguf, "--device", "cpu", "--prompt", bench.prompt_of(40),
                 "--max-new-tokens", "3"]) == 0
    r = bench.parse_generate_output(capsys.readouterr().err)
    assert r["warmup_prefill_s"] == 1.25 and r["load_s"] >= 0 and r["prompt_tokens"] == 40
    monkeypatch.undo()
    r = bench.run_generate(gguf, 40, 3, ["--device", "cpu"], timeout_s=120)
    assert "error" not in r, r.get("error")
    assert r["prompt_tokens"] == 40 and r["first_token_s"] > 0 and r["load_s"] > 0 and "warmup_prefill_s" not in r
    assert r["prefill_replayed"] == 0  # the CPU prefills eagerly


def test_the_replayed_prefill_parses_back():
    """generate's timing lines say when the prompt replayed a kept captured prefill (its tokens), and the benchmark
    reads it back; an eager prefill (the CPU's, or a GPU's with nothing captured) says nothing and reads 0."""
    from ktorch.cli import timing_lines
    from ktorch.generation import Timings

    replayed = Timings(prompt_tokens=512, new_tokens=64, first_token_s=0.054, warmup_s=2.5, decode_s=0.2,
                       cuda_graphs=True, prefill_replayed=2048)
    lines = timing_lines(replayed, load_s=57.4)
    assert "prefill replayed the captured 2048-token graph" in lines
    r = bench.parse_generate_output(lines)
    assert r["prefill_replayed"] == 2048 and r["prompt_tokens"] == 512 and r["capture_s"] == 2.5
    eager = timing_lines(Timings(prompt_tokens=40, new_tokens=3, first_token_s=0.1, decode_s=0.1), load_s=1.0)
    assert "replayed" not in eager and bench.parse_generate_output(eager)["prefill_replayed"] == 0


def test_breakdown_times_the_first_prefills_by_part(gguf, capsys):
    bench.main(["--gguf", gguf, "--breakdown", "2", "--prompts", "40", "--ktorch-args", "--device cpu"])
    out = capsys.readouterr().out
    assert re.search(r"loaded in [\d.]+ s on cpu \(prefill warm-up 0\.00 s\)", out), out  # none on the CPU
    first = re.search(r"P=40: first token ms by run: ([\d.]+), ([\d.]+)", out)
    assert first, out
    rows = {m[1].strip(): m[2] for m in re.finditer(r"^    (\S.*?)\s{2,}(?:ms )?([\d., ]+)$", out, re.M)}
    for part in ("attention, layer 0", "routed experts, layer 0", "MoE block less experts, layers 1+",
                 "rest (embedding, norms, lm_head, sampling)", "minor page faults"):
        assert part in rows, out
    timed = [float(rows[p].split(",")[0]) for p in rows if p not in ("minor page faults",
                                                                    "CPU op (kt.fused_moe on the worker)")]
    # the parts add up to the prefill, within their printed rounding (0.05 ms each, 0.005 the total)
    assert sum(timed) == pytest.approx(float(first[1]), abs=0.05 * len(timed) + 0.01)
    assert len(rows["minor page faults"].split(",")) == 2  # per run


def test_prefill_profile_times_each_variant_and_profiles_one_prefill(gguf, capsys, tmp_path):
    """--prefill-profile (host- or GPU-bound prefill): a warm time and the first tokens per variant and length, then
    one profiled prefill each (on the CPU: no GPU time, no launches) with its most called ATen ops; the variants
    compute the same values, so give the same first token; --profile-trace writes the first variant's profiled
    prefill as a gzipped Chrome trace."""
    import gzip
    import json

    variants = ["default", "sync-per-layer", "eager"]
    bench.main(["--gguf", gguf, "--prefill-profile", "2", "--prompts", "70", "--ktorch-args", "--device cpu",
                "--prefill-variants", *variants, "--profile-trace", str(tmp_path / "t")])
    out = capsys.readouterr().out
    firsts = re.findall(r"\] (.+?)\s+P=70: first token [\d.]+ ms warm .* first tokens (\[\d+\])", out)
    assert [v for v, _ in firsts] == variants, out
    assert len({t for _, t in firsts}) == 1
    profiled = re.findall(r"\] (.+?)\s+P=70 profiled: wall [\d.]+ ms, GPU busy 0\.0 ms, 0 GPU kernels/copies, 0 "
                          r"launches, 0 synchronizing calls", out)
    assert profiled == variants, out
    counts = re.findall(r"most called ATen ops: (.+)", out)
    assert len(counts) == len(variants) and all(re.match(r"\w+ \d+", c) for c in counts), out
    traces = list(tmp_path.glob("t.*.P70.json.gz"))
    assert len(traces) == 1 and f"trace: {traces[0]}" in out, out
    events = json.load(gzip.open(traces[0]))["traceEvents"]
    assert any(e.get("name", "").startswith("aten::") for e in events)


def _layer_events(t0: float, launch_wait: float, cpu_wait: float, host_blocked: float) -> tuple:
    """One split layer of a trace (us): the counts' read (10), the launching thread's wait for it, the GPU idle
    ``launch_wait``, the copy (1000), the grouped kernel (200), the wait kernel ``cpu_wait``, attention (300); the
    next layer's read follows. Returns (events, the next read's time)."""
    read = {"cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pageable)", "ts": t0, "dur": 10}
    sync = {"cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": t0 + 10 - host_blocked, "dur": host_blocked}
    t = t0 + 10 + launch_wait
    events = [read, sync]
    for name, dur in (("_gather_rows", 1000), ("_gate_up_grouped", 200), ("_wait_kernel", cpu_wait),
                      ("flash_fwd_kernel", 300)):
        events.append({"cat": "kernel", "name": name, "ts": t, "dur": dur})
        t += dur
    events.append({"cat": "cpu_op", "name": "aten::linear", "ts": t0 + 50, "dur": 40})  # host ops: not the GPU's
    return events, t


def test_layer_anatomy_names_what_bounds_each_layer():
    """Per layer from one counts read to the next: period, GPU busy, the GPU idle before the copy, the copy, the
    GPU's wait for the CPU op, the launching thread's wait at the read; the bound is the largest of the GPU's own
    work, the CPU op and the GPU's idle time (the launching thread). Medians over the layers; None without a split."""
    for launch_wait, cpu_wait, host_blocked, bound in ((2000, 0, 30, "the launching thread"),
                                                       (100, 3000, 800, "the CPU op"),
                                                       (100, 0, 900, "the GPU's work")):
        events, t = [], 0.0
        for _ in range(4):
            layer, t = _layer_events(t, launch_wait, cpu_wait, host_blocked)
            events += layer
        events.append({"cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pageable)", "ts": t, "dur": 10})
        a = bench.layer_anatomy(events)
        period = 10 + launch_wait + 1500 + cpu_wait
        assert a["layers"] == 4 and a["bound"] == bound, a
        assert a["period"] == pytest.approx(period / 1e3)
        assert a["gpu_busy"] == pytest.approx((10 + 1500 + cpu_wait) / 1e3)
        assert a["to_copy"] == pytest.approx(launch_wait / 1e3) and a["copy"] == pytest.approx(1.0)
        assert a["cpu_wait"] == pytest.approx(cpu_wait / 1e3)
        assert a["host_blocked"] == pytest.approx(host_blocked / 1e3)
    assert bench.layer_anatomy(_layer_events(0.0, 100, 0, 10)[0]) is None  # one read: no layer between two


def test_split_model_line_sums_predicted_against_measured():
    """The split's cost model against a prefill: sums of the predicted and measured seconds per side, per-call ratios
    (median/min/max) and the predicted CPU time's terms, by hand from three calls."""
    from ktorch.ops.routed_experts import SplitCall, SplitCosts

    costs = SplitCosts(h2d_bytes_per_s=1e9, cpu_fixed_s=1e-3, cpu_row_s=1e-6, cpu_expert_s=1e-4)
    calls = [SplitCall(cpu_rows=1000, cpu_experts=10, copied=2, device_rows=300, cpu_s=3e-3, device_s=2e-3,
                       device_timing=(4e-3,)),
             SplitCall(cpu_rows=500, cpu_experts=5, copied=0, device_rows=0, cpu_s=2e-3, device_s=0.0),
             SplitCall(cpu_rows=0, cpu_experts=0, copied=4, device_rows=800, cpu_s=0.0, device_s=5e-3,
                       device_timing=(5e-3,))]
    timeline = [(0, 6_000_000, 64), (10_000_000, 11_000_000, 64), (20_000_000, 20_500_000, 64)]  # 6, 1, 0.5 ms
    line = bench.split_model_line(calls, timeline, costs)
    # CPU: predicted 5 ms, measured 7.5; ratios 2 and 0.5 (the third call predicted 0: no ratio)
    assert "CPU predicted 5.0 ms / measured 7.5 ms (per call 1.25/0.50/2.00)" in line, line
    # device: the two calls with device work, predicted 7 ms, measured 9; ratios 2 and 1
    assert "device predicted 7.0 ms / measured 9.0 ms (per call 1.50/1.00/2.00, 2 calls with device work)" in line
    # fixed 2 calls x 1 ms, rows 1500 x 1 us, experts 15 x 0.1 ms
    assert "sums over 3 layer calls" in line and "fixed 2.0 + rows 1.5 + experts 1.5 ms" in line, line
    assert "per call 500 CPU rows, 5.0 CPU experts, 2.0 copied" in line, line
    assert "measured n/a (2 CPU op calls timed for 3 split calls)" in bench.split_model_line(calls, timeline[:2], costs)


def test_split_model_prefill_records_a_cpu_split_model():
    """split_model_prefill on a model whose split runs on the CPU (the 'device' is the CPU there, the CPU op inline,
    so untimed): one SplitCall per layer call, the device parts timed, and the model's calls switched off after."""
    import copy

    import ktorch
    from ktorch.ops.routed_experts import SplitCosts
    from models import moe_experts_modules, tiny_model

    torch.manual_seed(0)
    model = ktorch.prepare(copy.deepcopy(tiny_model("qwen3_moe", dtype=torch.float32)), device="cpu",
                           experts_dtype="bf16")
    # ~1 ms to copy a tiny int8 expert (12.5 KB), 0.1 ms a CPU row: of 24 tokens' 48 rows over 8 experts the best
    # split copies the ~3 most-hit experts and leaves the rest to the CPU, so both sides have a measured time (the
    # costs 1e9 B/s and 1 ms fixed sent every expert to the device on the H200: no CPU call to time)
    costs = SplitCosts(h2d_bytes_per_s=1.25e7, cpu_fixed_s=1e-4, cpu_row_s=1e-4, cpu_expert_s=0.0)
    ktorch.set_stream_experts(model, costs)
    modules = moe_experts_modules(model)
    for m in modules:
        m.kt_routed.min_tokens = 8
    ids = torch.randint(0, 256, (1, 24))
    with torch.no_grad():
        line = bench.split_model_prefill(model, 24, lambda P: model(ids), lambda: None, costs)
    assert f"measured n/a (0 CPU op calls timed for {len(modules)} split calls)" in line, line
    assert f"sums over {len(modules)} layer calls" in line and "calls with device work" in line, line
    assert all(m.kt_routed.calls is None for m in modules)
    assert ktorch.prefill_split_stats(model)["passes"] == len(modules)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_split_model_prefill_times_the_cpu_op_per_layer_call():
    """On CUDA the CPU op runs on the experts runtime's worker: its timeline has one call per split call, so the CPU
    side has a measured time and per-call ratios; the device parts are timed with CUDA events."""
    import copy

    import ktorch
    from ktorch.ops.routed_experts import SplitCosts
    from models import moe_experts_modules, tiny_model

    torch.manual_seed(0)
    # ~1 ms to copy a tiny int8 expert (12.5 KB), 0.1 ms a CPU row: of 24 tokens' 48 rows over 8 experts the best
    # split copies the ~3 most-hit experts and leaves the rest to the CPU, so both sides have a measured time (the
    # costs 1e9 B/s and 1 ms fixed sent every expert to the device on the H200: no CPU call to time)
    costs = SplitCosts(h2d_bytes_per_s=1.25e7, cpu_fixed_s=1e-4, cpu_row_s=1e-4, cpu_expert_s=0.0)
    model = ktorch.prepare(copy.deepcopy(tiny_model("qwen3_moe", dtype=torch.bfloat16)), device="cuda",
                           experts_dtype="int8", stream_experts=costs, gpu_memory="off")
    modules = moe_experts_modules(model)
    for m in modules:
        m.kt_routed.min_tokens = 8
    ids = torch.randint(0, 256, (1, 24), device="cuda")
    with torch.no_grad():
        model(ids)  # compiles the kernels
        line = bench.split_model_prefill(model, 24, lambda P: model(ids), torch.cuda.synchronize, costs)
    assert re.search(r"CPU predicted [\d.]+ ms / measured [\d.]+ ms \(per call [\d.]+/[\d.]+/[\d.]+\)", line), line
    assert f"sums over {len(modules)} layer calls" in line, line


def test_same_process_generates_each_prompt_through_the_command_lines_call(gguf, capsys, monkeypatch):
    """--same-process N: one load, then N prompts of each length through ``ktorch.cli.run_generation`` (the call
    `ktorch generate` makes), a line each with its prefill and decode rates; the prompts of a length differ."""
    import ktorch.cli

    seen = []
    original = ktorch.cli.run_generation

    def spy(model, tokenizer, ids, args, out=None):
        seen.append(ids.clone())
        return original(model, tokenizer, ids, args, out)

    monkeypatch.setattr(ktorch.cli, "run_generation", spy)
    bench.main(["--gguf", gguf, "--same-process", "3", "--prompts", "20", "33", "--gen", "4", "--ktorch-args",
                "--device cpu"])
    out = capsys.readouterr().out
    lines = re.findall(r"\[same process --device cpu\] P=(\d+) prompt (\d): prefill [\d.]+ ms \((\d+) tok/s\), "
                       r"decode ([\d.]+|n/a) tok/s", out)
    assert [(int(p), int(i)) for p, i, _, _ in lines] == [(20, 1), (20, 2), (20, 3), (33, 1), (33, 2), (33, 3)], out
    assert all(int(rate) > 0 for _, _, rate, _ in lines)
    assert [s.shape[1] for s in seen] == [20, 20, 20, 33, 33, 33]
    assert len({tuple(s[0].tolist()) for s in seen}) == 6


def test_cold_start_runs_fresh_processes_from_empty_caches_then_lists_the_compiles(gguf, capsys, monkeypatch):
    """--cold-start N: N generate processes with Triton's and Inductor's caches in one new folder, empty for the
    first and kept for the next, the caller's environment put back after; then the first again from other empty
    caches, whose listing (the child, in process: the command line's generate, its compiles) is printed."""
    import os
    import subprocess

    monkeypatch.setenv("TRITON_CACHE_DIR", "/the/callers/triton")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    seen = []

    def fake_run_generate(path, prompt, gen, extra, timeout_s, prompt_kind):
        triton, inductor = os.environ["TRITON_CACHE_DIR"], os.environ["TORCHINDUCTOR_CACHE_DIR"]
        seen.append((triton, inductor, os.path.exists(triton) and bool(os.listdir(triton))))
        os.makedirs(triton, exist_ok=True)
        open(os.path.join(triton, "kernel"), "w").close()  # what a process leaves in the cache
        return {"load_s": 30.0, "warmup_prefill_s": 2.5, "capture_s": 9.0 if not seen[:-1] else 2.0,
                "first_token_s": 0.1}

    children = []
    real_run = subprocess.run

    def fake_subprocess_run(cmd, **kw):
        if "--cold-start-child" not in cmd:
            return real_run(cmd, **kw)
        children.append((cmd, kw["env"]))
        return subprocess.CompletedProcess(cmd, 0, stdout="[compiles defaults] generate 40.0 s\n    _gather_rows in "
                                           "0.5 s\nnoise\n", stderr="")

    monkeypatch.setattr(bench, "run_generate", fake_run_generate)
    monkeypatch.setattr(bench.subprocess, "run", fake_subprocess_run)
    bench.main(["--gguf", gguf, "--cold-start", "3", "--prompts", "64", "--gen", "2"])
    out = capsys.readouterr().out
    assert len(seen) == 3 and len({(t, i) for t, i, _ in seen}) == 1  # one folder for the three
    assert [had for _, _, had in seen] == [False, True, True]  # empty for the first, kept after
    assert os.environ["TRITON_CACHE_DIR"] == "/the/callers/triton" and "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    assert "process 0 (empty caches): load 30.0 s (warm-up prefill and its captures 2.50 s), decode capture 9.00" in out
    assert "process 2 (caches of the ones before)" in out and "decode capture 2.00" in out
    (cmd, env), = children
    assert env["TRITON_CACHE_DIR"] != seen[0][0] and "--prompts" in cmd and cmd[cmd.index("--prompts") + 1] == "64"
    assert "    _gather_rows in 0.5 s" in out and "noise" not in out


def test_cold_start_child_runs_the_command_lines_generate_and_lists_compiles(gguf, capsys):
    """The child: ``ktorch generate``'s own function in process (its output as generate prints it), then the
    compile listing (none on the CPU: ktorch's Triton kernels and Inductor compile for the GPU's paths)."""
    bench.main(["--gguf", gguf, "--cold-start-child", "--prompts", "40", "--gen", "3", "--ktorch-args",
                "--device cpu"])
    captured = capsys.readouterr()
    r = bench.parse_generate_output(captured.err)
    assert r["prompt_tokens"] == 40 and r["decode_tokens"] >= 1
    assert "[compiles --device cpu] generate" in captured.out and "0 specializations" in captured.out
    assert "Dynamo/Inductor compile_times" in captured.out
