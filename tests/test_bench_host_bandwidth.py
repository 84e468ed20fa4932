"""benchmarks/bench_host_bandwidth.py: the prefill floor's arithmetic, and a smoke run of the CPU part (the copy
rows need a GPU; on the device: python benchmarks/bench_host_bandwidth.py). Its numbers here mean nothing."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import load_benchmark

bench = load_benchmark("bench_host_bandwidth")


def test_layer_bytes_and_floor():
    E, H, I, layers = bench.SHAPES["qwen3-30b-a3b"]
    assert bench.layer_bytes_int8(E, H, I) == 128 * (3 * 2048 * 768 + 4 * (2 * 768 + 2048))
    # every layer's bytes at 100 GB/s: 48 x 606 MB = 29.1 GB -> 0.291 s for a prompt of any length
    seconds = layers * bench.layer_bytes_int8(E, H, I) / 100e9
    assert bench.floor_tokens_per_s(100.0, "qwen3-30b-a3b", 512) == pytest.approx(512 / seconds)
    assert bench.floor_tokens_per_s(50.0, "qwen3-30b-a3b", 2048) == pytest.approx(2048 / (2 * seconds))


def test_cpu_smoke_run(capsys, tmp_path):
    before = torch.get_num_threads()
    rows = bench.main(["--threads", "1", "--cpu-gib", "0.05", "--repeats", "1", "--no-gpu", "--shape", "tiny",
                       "--tokens", "7", "--json", str(tmp_path / "rows.jsonl")])
    assert torch.get_num_threads() == before
    out = capsys.readouterr().out
    assert len(rows) == 1 and rows[0]["threads"] == 1 and rows[0]["cpu_alone"] > 0
    assert "copy_alone" not in rows[0]
    table = [line for line in out.splitlines() if line.startswith("| 1 |")]
    assert len(table) == 1 and table[0].count(" - ") == 8  # copy and gather: alone, both while, their sum
    floor = bench.floor_tokens_per_s(rows[0]["cpu_alone"], "tiny", 7)
    assert f"pp7 <= {floor:.0f} tok/s" in out
    lines = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert lines == [dict(rows[0], bench="host_bandwidth", shape="tiny")]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_copy_and_gather_rows(capsys):
    """On a GPU: the DMA copy and the zero-copy gather of the same registered bytes each get a rate alone and while
    the CPU reads, printed side by side."""
    rows = bench.main(["--threads", "1", "--cpu-gib", "0.05", "--repeats", "1", "--copy-mib", "16", "--copies", "2",
                       "--shape", "tiny", "--tokens", "7"])
    for name in ("copy", "gather"):
        assert rows[0][f"{name}_alone"] > 0 and rows[0][f"{name}_while_reading"] > 0
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 1 |")]
    assert len(table) == 1 and " - " not in table[0]
