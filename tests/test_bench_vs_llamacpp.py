"""benchmarks/bench_vs_llamacpp.py without llama.cpp: reading llama-bench's output (-o json / -o jsonl, as its
printers in tools/llama-bench/llama-bench.cpp write them), picking the best setting per test, the commands, a
fake llama-bench run through the script's subprocess path, and the comparison table."""

from __future__ import annotations

import json
import math
import stat
from pathlib import Path

import pytest

from conftest import load_benchmark

vs = load_benchmark("bench_vs_llamacpp")

# One record as llama-bench (CPU build, this repo's fetched llama.cpp) printed it with -o jsonl.
JSONL_RECORD = (
    '{"build_commit": "unknown", "build_number": 0, "cpu_info": "AMD EPYC", "gpu_info": "", "backends": "CPU", '
    '"model_filename": "/tmp/vs/t.gguf", "model_type": "qwen3moe ?B Q4_0", "model_size": 1623221248, '
    '"model_n_params": 1245452544, "n_batch": 2048, "n_ubatch": 512, "n_threads": 2, "cpu_mask": "0x0", '
    '"cpu_strict": false, "poll": 50, "type_k": "f16", "type_v": "f16", "n_gpu_layers": 99, "n_cpu_moe": 0, '
    '"split_mode": "layer", "main_gpu": 0, "no_kv_offload": false, "flash_attn": -1, "devices": "auto", '
    '"tensor_split": "0.00", "tensor_buft_overrides": "exps=CPU", "load_mode": "auto", "lazy_mode": "auto", '
    '"embeddings": false, "no_op_offload": 0, "no_host": false, "repack": true, "fit_target": 0, "fit_min_ctx": 0, '
    '"n_prompt": 32, "n_gen": 0, "n_depth": 0, "test_time": "2026-11-23T10:22:40Z", "avg_ns": 90333235, '
    '"stddev_ns": 93821056, "avg_ts": 769.018865, "stddev_ts": 798.711151, "samples_ns": [ 156674740, 23991730 ],'
    '"samples_ts": [ 204.245, 1333.79 ]}'
)


def record(**changes) -> dict:
    r = json.loads(JSONL_RECORD)
    r.update(changes)
    return r


def jsonl_line(r: dict) -> str:
    """A record in jsonl_printer's layout: fields, then the sample arrays."""
    fields = ", ".join(f'"{k}": {json.dumps(v)}' for k, v in r.items() if not k.startswith("samples_"))
    return "{" + fields + f', "samples_ns": [ {", ".join(map(str, r["samples_ns"]))} ],' \
        f'"samples_ts": [ {", ".join(map(str, r["samples_ts"]))} ]' + "}"


def json_array(records: list[dict]) -> str:
    """Records in json_printer's layout: "[", objects of one field a line joined by ",\\n", "]"."""
    objects = []
    for r in records:
        body = "".join(f'    "{k}": {json.dumps(v)},\n' for k, v in r.items() if not k.startswith("samples_"))
        body += f'    "samples_ns": [ {", ".join(map(str, r["samples_ns"]))} ],\n'
        body += f'    "samples_ts": [ {", ".join(map(str, r["samples_ts"]))} ]\n'
        objects.append("  {\n" + body + "  }")
    return "[\n" + ",\n".join(objects) + "\n]\n"


SWEEP = [
    record(n_prompt=512, n_gen=0, n_threads=15, flash_attn=0, n_ubatch=512, load_mode="auto", avg_ts=400.0),
    record(n_prompt=512, n_gen=0, n_threads=16, flash_attn=1, n_ubatch=512, load_mode="none", avg_ts=519.5),
    record(n_prompt=2048, n_gen=0, n_threads=16, flash_attn=1, n_ubatch=2048, load_mode="none", avg_ts=854.0),
    record(n_prompt=2048, n_gen=0, n_threads=16, flash_attn=1, n_ubatch=512, load_mode="none", avg_ts=700.0),
    record(n_prompt=0, n_gen=64, n_threads=15, flash_attn=0, n_ubatch=512, load_mode="auto", avg_ts=27.7),
    record(n_prompt=0, n_gen=64, n_threads=16, flash_attn=1, n_ubatch=512, load_mode="auto", avg_ts=26.5),
]


def test_parse_jsonl_real_line():
    (r,) = vs.parse_llama_bench(JSONL_RECORD + "\n")
    assert r["n_prompt"] == 32 and r["n_threads"] == 2 and r["flash_attn"] == -1
    assert r["avg_ts"] == pytest.approx(769.018865)
    assert r["samples_ts"] == [204.245, 1333.79]
    assert vs.llama_test_name(r) == "pp32"
    assert vs.setting_label(r) == "-t 2 -fa auto -lm auto -ub 512"


def test_parse_json_array_and_jsonl_agree():
    from_array = vs.parse_llama_bench(json_array(SWEEP))
    from_lines = vs.parse_llama_bench("".join(jsonl_line(r) + "\n" for r in SWEEP))
    assert from_array == from_lines == SWEEP


def test_parse_cut_off_output_keeps_finished_tests():
    text = json_array(SWEEP[:3])
    cut = text[: text.rindex('"avg_ts"')]  # the third record cut off midway, no closing bracket
    assert vs.parse_llama_bench(cut) == SWEEP[:2]
    lines = "".join(jsonl_line(r) + "\n" for r in SWEEP[:2]) + jsonl_line(SWEEP[2])[:100]
    assert vs.parse_llama_bench(lines) == SWEEP[:2]


def test_parse_skips_noise_and_nan():
    text = "some log line\n" + jsonl_line(SWEEP[0]) + "\n" + jsonl_line(SWEEP[1]).replace("519.5", "nan") + "\n"
    records = vs.parse_llama_bench(text)
    assert len(records) == 2 and records[1]["avg_ts"] is None
    assert vs.best_per_test(records)["pp512"] is records[0]  # the failed (nan) test is never the best
    assert vs.parse_llama_bench("") == []


def test_best_per_test_and_labels():
    best = vs.best_per_test(SWEEP)
    assert set(best) == {"pp512", "pp2048", "tg64"}
    assert best["pp512"]["avg_ts"] == 519.5
    assert vs.setting_label(best["pp512"]) == "-t 16 -fa 1 -lm none -ub 512"
    assert vs.setting_label(best["pp2048"]) == "-t 16 -fa 1 -lm none -ub 2048"
    assert vs.setting_label(best["tg64"]) == "-t 15 -fa 0 -lm auto"  # the micro-batch does not matter for decode
    assert vs.llama_test_name(record(n_prompt=512, n_gen=64)) == "pp512+tg64"


def test_commands_one_per_test():
    cmds = vs.llama_bench_commands("/b/llama-bench", "/tmp/m.gguf", [512, 2048], 64, "15,16", "0,1", "auto,none",
                                   "512,2048", 5, ["--poll", "100"])
    assert len(cmds) == 3
    for c in cmds:
        assert c[:7] == ["/b/llama-bench", "-m", "/tmp/m.gguf", "-ngl", "99", "-ot", "exps=CPU"]
        assert c[c.index("-t") + 1] == "15,16" and c[c.index("-fa") + 1] == "0,1"
        assert c[c.index("-lm") + 1] == "auto,none"
        assert c[c.index("-o") + 1] == "jsonl" and c[c.index("-r") + 1] == "5" and "--poll" in c
    pp512, pp2048, tg = cmds
    def value(cmd, flag):
        return cmd[cmd.index(flag) + 1]

    assert (value(pp512, "-p"), value(pp512, "-n"), value(pp512, "-ub")) == ("512", "0", "512")
    assert pp2048[pp2048.index("-ub") + 1] == "512,2048"
    assert (tg[tg.index("-p") + 1], tg[tg.index("-n") + 1]) == ("0", "64") and "-ub" not in tg
    small = vs.llama_bench_commands("x", "m", [64], 0, "2", "1", "auto", "512,2048", 1, [])
    assert len(small) == 1 and small[0][small[0].index("-ub") + 1] == "64"


def _fake_llama_bench(tmp_path: Path, body: str) -> str:
    path = tmp_path / "llama-bench"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_run_fake_llama_bench(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text("".join(jsonl_line(r) + "\n" for r in SWEEP))
    fake = _fake_llama_bench(tmp_path, f'echo "loading model" >&2\ncat {out}\n')
    assert vs.find_llama_bench(fake) == fake
    assert vs.find_llama_bench(str(tmp_path / "missing")) is None
    log = tmp_path / "llama_bench.log"
    records = vs.run_llama_bench([[fake, "-m", "x.gguf"]], log, timeout_s=30)
    assert records == SWEEP
    assert "loading model" in log.read_text()


def test_run_fake_llama_bench_timeout_keeps_finished_tests(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text(jsonl_line(SWEEP[0]) + "\n")
    fake = _fake_llama_bench(tmp_path, f"cat {out}\nexec sleep 30\n")
    records = vs.run_llama_bench([[fake]], tmp_path / "log", timeout_s=1)
    assert records == SWEEP[:1]


def _lines() -> list[dict]:
    lines = [dict(kind="machine", cpu="Xeon", cores=16)]
    for r in SWEEP:
        lines.append(dict(kind="llama.cpp", experts_type="Q8_0", layers=12, test=vs.llama_test_name(r),
                          setting=vs.setting_label(r), tok_s=r["avg_ts"], record=r))
    lines.append(dict(kind="ktorch", experts_type="Q8_0", layers=12, device="cuda", variant="compiled",
                      tests={"pp512": 1000.0, "pp2048": 2000.0, "tg64": 40.0}))
    lines.append(dict(kind="ktorch", experts_type="Q8_0", layers=12, device="cuda", variant="cuda_graphs",
                      tests={"pp512": 900.0, "pp2048": 1900.0, "tg64": 55.4}))
    lines.append(dict(kind="ktorch", experts_type="Q4_0", layers=12, device="cuda", variant="compiled",
                      tests={"tg64": 60.0}))
    return lines


def test_comparison_rows_best_of_each_side():
    rows = vs.comparison_rows(_lines())
    assert [(r["experts_type"], r["test"]) for r in rows] == [("Q8_0", "pp512"), ("Q8_0", "pp2048"), ("Q8_0", "tg64"),
                                                              ("Q4_0", "tg64")]
    pp512, pp2048, tg, q4 = rows
    assert pp512["llama_tok_s"] == 519.5 and pp512["llama_setting"] == "-t 16 -fa 1 -lm none -ub 512"
    assert pp512["llama_settings_tried"] == 2
    assert pp512["ktorch_variant"] == "compiled" and pp512["ratio"] == pytest.approx(1000.0 / 519.5)
    assert tg["ktorch_variant"] == "cuda_graphs" and tg["ratio"] == pytest.approx(2.0)
    assert pp2048["llama_setting"].endswith("-ub 2048")
    assert "llama_tok_s" not in q4 and "ratio" not in q4  # no llama.cpp run: its columns stay empty

    table = vs.format_table(rows)
    assert "| Q8_0 (12 layers) | tg64 | 27.7 (`-t 15 -fa 0 -lm auto`) | 55.4 (`cuda_graphs`) | 2.00x |" in table
    assert "| Q4_0 (12 layers) | tg64 | - | 60.0 (`compiled`) | - |" in table


def test_report_prints_the_table(tmp_path, capsys):
    path = tmp_path / "vs.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in _lines()))
    vs.main(["--report", str(path)])
    out = capsys.readouterr().out
    assert 'machine: {"cpu": "Xeon", "cores": 16}' in out
    assert "| experts | test | llama.cpp tok/s (best setting) |" in out
    assert out.count("| Q8_0 (12 layers) |") == 3
    assert not math.isnan(vs.comparison_rows(_lines())[0]["ratio"])


def test_comparison_takes_the_median_of_a_settings_processes():
    lines = [dict(kind="ktorch", experts_type="Q8_0", layers=12, variant="defaults", tests={"tg64": ts})
             for ts in (30.0, 10.0, 20.0)]
    lines.append(dict(kind="ktorch", experts_type="Q8_0", layers=12, variant="--deferred-experts 3",
                      tests={"tg64": 25.0}))
    row, = vs.comparison_rows(lines)
    assert row["ktorch_variant"] == "--deferred-experts 3" and row["ktorch_tok_s"] == 25.0  # 25 > median 20
    lines.append(dict(kind="ktorch", experts_type="Q8_0", layers=12, variant="defaults", tests={"tg64": 40.0}))
    row, = vs.comparison_rows(lines)
    assert row["ktorch_variant"] == "defaults" and row["ktorch_tok_s"] == 25.0 and row["ktorch_runs"] == 4


def test_run_ktorch_runs_ktorch_generate_as_typed(tmp_path):
    """The ktorch side is `ktorch generate` processes on the file (no harness): each setting's figures are the
    ones the process printed; the decode figure comes from the shortest prompt's run."""
    from ktorch.integrations.gguf_writer import write_random_qwen3moe_gguf

    path = write_random_qwen3moe_gguf(tmp_path / "t.gguf", experts_type="Q8_0", num_layers=2, num_experts=8,
                                      experts_per_token=2, hidden_size=64, expert_intermediate_size=64, num_heads=4,
                                      num_kv_heads=2, head_dim=16, vocab_size=256, distinct_experts=2, progress=False)
    lines = list(vs.run_ktorch(path, [24, 9], 5, ["", "--deferred-experts 1 --device cpu"], 1, 300))
    assert [(line["variant"], line["prompt"]) for line in lines] == [
        ("defaults", 24), ("defaults", 9), ("--deferred-experts 1 --device cpu", 24),
        ("--deferred-experts 1 --device cpu", 9)]
    for line in lines:
        assert "error" not in line, line.get("error")
        assert line["command"].startswith(f"ktorch generate --model {path} --prompt <{line['prompt']} bytes> "
                                          "--max-new-tokens 5")
        assert line["prompt_tokens"] == line["prompt"] and line["tests"][f"pp{line['prompt']}"] == line["prefill_tok_s"]
        if line["prompt"] == 9:
            # the first new token is prefill's; on a GPU the capture's eager step makes one more, untimed
            assert line["tests"]["tg5"] == line["decode_tok_s"] > 0 and line["decode_tokens"] in (3, 4)
        else:
            assert "tg5" not in line["tests"]
    assert lines[2]["command"].endswith("--deferred-experts 1 --device cpu")
