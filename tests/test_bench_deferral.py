"""benchmarks/bench_deferral.py speed on the CPU with a tiny random GGUF: the model comes from `ktorch generate`'s
own loader (ktorch.cli.load_model with the parsed options) and each row's figures from its own call
(ktorch.cli.run_generation), with the row's deferral set on the model and a fresh decoder per row."""

from __future__ import annotations

import argparse

from conftest import load_benchmark

deferral = load_benchmark("bench_deferral")
e2e = load_benchmark("bench_e2e")
vs = load_benchmark("bench_vs_llamacpp")


def test_speed_rows_come_from_the_cli_loader_and_call(tmp_path, monkeypatch):
    import ktorch.cli

    loaded, calls = [], []
    load_model, run_generation = ktorch.cli.load_model, ktorch.cli.run_generation

    def spy_load(args):
        loaded.append(args)
        return load_model(args)

    def spy_run(model, tokenizer, ids, args, out=None):
        calls.append((model.kt_deferred_experts, getattr(model, "kt_decoder", None), ids.shape[1],
                      args.max_new_tokens))
        return run_generation(model, tokenizer, ids, args, out=out)

    monkeypatch.setattr(ktorch.cli, "load_model", spy_load)
    monkeypatch.setattr(ktorch.cli, "run_generation", spy_run)
    args = deferral.build_parser().parse_args(
        ["speed", "--shape", "tiny", "--layers", "2", "--gguf-dir", str(tmp_path), "--deferred", "0,1",
         "--gpu-experts", "0", "--prompt", "12", "--decode-tokens", "6", "--ktorch-args", "--device cpu"])
    rows = deferral.run_speed(args)
    assert [r["n_deferred_experts"] for r in rows] == [0, 1]
    assert all(r["decode_tok_s"] > 0 and r["prompt_tokens"] == 12 and r["decode_tokens"] == 5 for r in rows)
    (parsed,), = [loaded]
    assert isinstance(parsed, argparse.Namespace) and parsed.command == "generate" and parsed.device == "cpu"
    assert parsed.model.endswith("tiny-random-Q8_0-2l.gguf") and parsed.deferred_experts == 0
    assert [(d, dec, p, n) for d, dec, p, n in calls] == [(0, None, 12, 6), (1, None, 12, 6)]  # fresh decoder each
    assert not list(tmp_path.iterdir())  # the file it wrote is gone (no --keep)


def test_the_end_to_end_benchmarks_name_the_same_file(tmp_path):
    """bench_e2e.py reuses the file bench_vs_llamacpp.py wrote (benchmarks/device_onepath.sh relies on it): same
    name, and the writer's defaults (the Qwen3-30B-A3B shape) for both."""
    path = vs.gguf_path(str(tmp_path), "Q8_0", 12, 128)
    path.write_bytes(b"")
    assert e2e.GGUF_SHAPES["qwen3-30b-a3b"] == {}
    assert e2e.gguf_for("qwen3-30b-a3b", "Q8_0", 12, str(tmp_path)) == (str(path), False)
