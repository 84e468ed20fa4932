"""The ``ktorch`` command (ktorch/cli.py): help, generate on the built-in model, chat, bench, clear errors."""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import sys
from typing import Optional

import pytest

from ktorch.cli import build_parser, main

TIMING = re.compile(r"prefill: \d+ tokens in [\d.]+ s \([\d.]+ tok/s\) \| decode: \d+ tokens in [\d.]+ s \([\d.]+ tok/s\)")


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m ktorch.cli ARGS`` in a fresh process: what the ``ktorch`` console script runs."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "ktorch.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for command in ("generate", "chat", "bench"):
        assert command in out


@pytest.mark.parametrize("command", ["generate", "chat", "bench"])
def test_every_option_has_help(command):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    for action in sub._actions:
        if action.dest != "help":
            assert action.help and len(action.help) > 10, f"ktorch {command}: {action.option_strings or action.dest}"


def test_generate_help_names_the_options(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = capsys.readouterr().out
    for option in ("--model", "--prompt", "--max-new-tokens", "--experts-dtype", "--deferred-experts", "--device"):
        assert option in out


def test_console_script_is_installed():
    path = shutil.which("ktorch")
    if path is None:
        pytest.skip("no 'ktorch' executable on PATH: the package is not pip-installed in this environment")
    result = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "generate" in result.stdout


def test_generate_builtin_streams_text_and_rates():
    result = run_cli("generate", "--model", "builtin", "--prompt", "hi", "--max-new-tokens", "4")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("hi") and len(result.stdout) > len("hi")
    assert TIMING.search(result.stderr), result.stderr
    assert "experts bf16 on cpu (kt.fused_moe)" in result.stderr


def test_generate_int8_experts_in_process(capsys):
    assert main(["generate", "--model", "builtin", "--prompt", "The", "--max-new-tokens", "3", "--experts-dtype", "int8"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("The")
    assert TIMING.search(captured.err) and "experts int8 on cpu" in captured.err


def test_generate_reads_the_prompt_from_stdin(capsys, monkeypatch):
    """--prompt - takes standard input as the prompt (the same greedy completion as the text given inline); an empty
    prompt, inline or read, is refused before the model loads."""
    args = ["generate", "--model", "builtin", "--max-new-tokens", "5"]
    assert main([*args, "--prompt", "Once upon a time"]) == 0
    inline = capsys.readouterr().out
    monkeypatch.setattr(sys, "stdin", io.StringIO("Once upon a time"))
    assert main([*args, "--prompt", "-"]) == 0
    assert capsys.readouterr().out == inline and inline.startswith("Once upon a time")
    for prompt, stdin in (("-", ""), ("", "unused")):
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        assert main([*args, "--prompt", prompt]) == 1
        err = capsys.readouterr().err
        assert "--prompt is empty" in err and "loaded" not in err and "Traceback" not in err


def test_generate_plain_matches_prepared_bf16(capsys):
    """Greedy text of transformers' own experts and of kt.fused_moe (bf16) agree on a short completion."""
    args = ["generate", "--model", "builtin", "--prompt", "Python is", "--max-new-tokens", "6", "--dtype", "fp32"]
    assert main(args) == 0
    prepared = capsys.readouterr().out
    assert main(args + ["--plain"]) == 0
    assert capsys.readouterr().out == prepared


def test_run_generation_matches_transformers_generate_and_reports_times():
    """The CLI's generation (ktorch.generate) gives transformers' greedy tokens on the same prepared model, and the
    timing lines name the load, the first token and (CPU: none) the capture."""
    import ktorch
    from ktorch.builtin import BUILTIN_PATH
    from ktorch.cli import run_generation, timing_lines

    model, tokenizer = ktorch.load(str(BUILTIN_PATH), device="cpu")[:2]
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    args = build_parser().parse_args(["generate", "--prompt", "x", "--max-new-tokens", "9"])
    out = io.StringIO()
    got, timings = run_generation(model, tokenizer, ids, args, out=out)
    want = model.generate(ids, max_new_tokens=9, do_sample=False)[0, ids.shape[1]:].tolist()
    assert got == want
    assert out.getvalue().strip() == tokenizer.decode(got, skip_special_tokens=True).strip()
    lines = timing_lines(timings, load_s=1.25)
    assert TIMING.search(lines) and "load 1.2 s" in lines and "first token" in lines and "capture" not in lines


def test_bad_model_path_is_a_clear_error(tmp_path):
    missing = tmp_path / "no-such-model"
    result = run_cli("generate", "--model", str(missing), "--prompt", "hi")
    assert result.returncode != 0
    assert f"--model {missing}: no such file or folder" in result.stderr
    assert "Traceback" not in result.stderr


def test_folder_without_config_is_a_clear_error(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path), "--prompt", "hi"]) == 1
    assert "no config.json" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize("option,value,message", [
    ("--max-new-tokens", "0", "--max-new-tokens must be >= 1, got 0"),
    ("--max-new-tokens", "-3", "--max-new-tokens must be >= 1, got -3"),
    ("--temperature", "-1", "--temperature must be >= 0, got -1.0"),
    ("--temperature", "nan", "--temperature must be >= 0, got nan"),
    ("--top-p", "2", "--top-p must be in (0, 1], got 2.0"),
    ("--top-p", "0", "--top-p must be in (0, 1], got 0.0"),
    ("--repetition-penalty", "0", "--repetition-penalty must be > 0, got 0.0"),
])
def test_bad_generation_options_are_clear_errors_before_loading(command, option, value, message, capsys,
                                                                 monkeypatch):
    """Checked before the model loads (a traceback after seconds of loading, before), even where greedy decoding
    would not read the option (--top-p at temperature 0)."""
    import ktorch.cli

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(ktorch.cli, "load_model", no_loading)
    prompt = ["--prompt", "hi"] if command == "generate" else []
    assert main([command, "--model", "builtin", *prompt, option, value]) == 1
    err = capsys.readouterr().err
    assert f"ktorch {command}: error: {message}" in err
    assert "Traceback" not in err


def test_a_prompt_past_the_context_is_one_warning_line():
    """The built-in model has 2048 positions: a longer prompt still runs, with ktorch's warning as one line of the
    command's (no source location)."""
    result = run_cli("generate", "--model", "builtin", "--prompt", "word " * 2100, "--max-new-tokens", "2")
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if "warning" in line]
    assert len(lines) == 1 and re.fullmatch(r"ktorch generate: warning: the prompt \(\d+ tokens\) and max_new_tokens "
                                            r"\(2\) pass this model's context of 2048 positions .*", lines[0]), lines
    # the rates line; its decode rate only where a token came after the first (on the device's GPU the built-in
    # model ended its answer there: "decode: 0 tokens")
    assert "UserWarning" not in result.stderr
    assert re.search(r"^prefill: \d+ tokens in [\d.]+ s \([\d.]+ tok/s\) \| decode: \d+ tokens", result.stderr, re.M)


def test_gguf_header_only_is_reported_corrupt(tmp_path, capsys):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert main(["generate", "--model", str(gguf), "--prompt", "hi"]) == 1
    assert "cannot parse it as GGUF" in capsys.readouterr().err


def test_generate_with_deferred_experts(capsys, monkeypatch):
    """--deferred-experts 2 on the built-in model (top-4): the experts modules defer, text and rates come out."""
    import ktorch

    seen = []
    set_deferred = ktorch.set_deferred_experts
    monkeypatch.setattr(ktorch, "set_deferred_experts", lambda model, d: seen.append(d) or set_deferred(model, d))
    assert main(["generate", "--model", "builtin", "--prompt", "Once upon a time", "--max-new-tokens", "6",
                 "--deferred-experts", "2", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    assert seen == [2] and TIMING.search(captured.err) and captured.out.strip()


def test_loading_ends_with_the_warm_up(capsys, monkeypatch):
    """generate, chat and serve load through load_model, which ends with ktorch.warm_up (a no-op on the CPU; the CUDA
    tests time it: tests/test_routed_experts.py) after the placement options (here: the deferral is set when it
    runs), with ktorch.load told not to warm up itself; the loading line prints its seconds. --plain runs none, and
    serve none unless --cuda-graphs off (its engine warms up itself before serving), and then without the kept
    captured prefill (capture=False: the engine runs its own steps), which generate and chat ask for."""
    import ktorch
    import ktorch.serve

    calls, loads = [], []
    load = ktorch.load
    captures = []
    monkeypatch.setattr(ktorch, "warm_up", lambda model, capture=True: calls.append(model.kt_deferred_experts)
                        or captures.append(capture) or 1.25)
    monkeypatch.setattr(ktorch, "load", lambda *a, **k: loads.append(k.get("warm_up")) or load(*a, **k))
    monkeypatch.setattr(ktorch.serve, "run_server", lambda *a, **k: None)
    monkeypatch.setattr(sys, "stdin", io.StringIO("/exit\n"))
    common = ["--model", "builtin", "--device", "cpu", "--deferred-experts", "1"]
    assert main(["generate", *common, "--prompt", "The", "--max-new-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert calls == [1] and loads == [False]
    assert re.search(r"loaded in [\d.]+ s \(prefill warm-up 1\.25 s\)\n", err), err
    assert main(["chat", *common]) == 0 and calls == [1, 1] and captures == [True, True]
    assert "(prefill warm-up 1.25 s)" in capsys.readouterr().err
    assert main(["generate", "--model", "builtin", "--device", "cpu", "--prompt", "The", "--max-new-tokens", "2",
                 "--plain"]) == 0
    assert calls == [1, 1] and "prefill warm-up" not in capsys.readouterr().err
    refusal = serve_refusal(["serve", *common], capsys)
    if refusal is not None:
        assert calls == [1, 1]  # refused before loading
        pytest.skip(f"serve's part: {refusal}")
    assert main(["serve", *common]) == 0 and calls == [1, 1]
    assert "prefill warm-up" not in capsys.readouterr().err
    assert main(["serve", *common, "--cuda-graphs", "off"]) == 0 and calls == [1, 1, 1]
    assert captures == [True, True, False]
    assert "(prefill warm-up 1.25 s)" in capsys.readouterr().err
    monkeypatch.undo()  # the real one: nothing on the CPU, so nothing printed
    assert main(["generate", "--model", "builtin", "--device", "cpu", "--prompt", "The", "--max-new-tokens", "2"]) == 0
    assert "prefill warm-up" not in capsys.readouterr().err


def test_placement_option_errors(capsys):
    assert main(["generate", "--model", "builtin", "--prompt", "hi", "--deferred-experts", "5", "--device", "cpu"]) == 1
    assert "routes each token to 4 experts" in capsys.readouterr().err
    assert main(["generate", "--model", "builtin", "--prompt", "hi", "--deferred-experts", "-1"]) == 1
    assert "--deferred-experts must be >= 0" in capsys.readouterr().err
    assert main(["generate", "--model", "builtin", "--prompt", "hi", "--group-size", "32"]) == 1
    assert "--group-size applies to --experts-dtype int4 only" in capsys.readouterr().err
    assert main(["generate", "--model", "builtin", "--prompt", "hi", "--stream-experts", "auto", "--device", "cpu"]) == 1
    assert "place experts on a GPU" in capsys.readouterr().err
    assert main(["generate", "--model", "builtin", "--prompt", "hi", "--gpu-memory", "1GiB", "--device", "cpu"]) == 1
    assert "place experts on a GPU" in capsys.readouterr().err
    assert main(["generate", "--model", "builtin", "--prompt", "hi", "--gpu-memory", "24 parsecs"]) == 1
    assert "--gpu-memory 24 parsecs: gpu_memory: '24 parsecs' is not a size" in capsys.readouterr().err
    assert main(["generate", "--model", "builtin", "--prompt", "hi", "--no-compile", "--device", "cpu"]) == 1
    assert "--no-compile turns off the CUDA graph of the decode step" in capsys.readouterr().err
    assert main(["generate", "--model", "builtin", "--prompt", "hi", "--stream-experts", "512=0.4"]) == 1
    assert "expected off, auto or MIN_TOKENS:SHARE" in capsys.readouterr().err


def test_chat_session(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Tell me a joke.\n/reset\nHello\n/exit\n"))
    assert main(["chat", "--model", "builtin", "--max-new-tokens", "5", "--temperature", "0"]) == 0
    captured = capsys.readouterr()
    assert len(TIMING.findall(captured.err)) == 2  # one reply per message, none for the commands
    assert "(history cleared)" in captured.err


def test_bench_passes_arguments_through():
    result = run_cli("bench", "--", "--help", timeout=60)
    assert result.returncode == 0, result.stderr
    assert "--shapes" in result.stdout


@pytest.mark.parametrize("name, option", [("op", "--shapes"), ("generate", "--ktorch-args"), ("e2e", "--variants"),
                                          ("deferral", "--deferred"),
                                          ("overhead", "--calls"), ("vs-llamacpp", "--llama-reps"),
                                          ("vs-kt-kernel", "--kt-threads")])
def test_bench_names_pick_the_script(name, option):
    result = run_cli("bench", name, "--", "--help", timeout=60)
    assert result.returncode == 0, result.stderr
    assert option in result.stdout


def test_bench_e2e_runs_end_to_end_on_a_tiny_model(tmp_path):
    """ktorch bench e2e: `ktorch generate` on a random GGUF of the shape (its printed figures) beside transformers'
    generate on the offloaded model; the file it wrote is deleted."""
    result = run_cli("bench", "e2e", "--", "--shape", "tiny", "--prompts", "16", "--decode-tokens", "5",
                     "--baseline-decode-tokens", "3", "--gguf-dir", str(tmp_path), timeout=300)
    assert result.returncode == 0, result.stderr
    assert re.search(r"^\$ ktorch generate --model \S+tiny-random-Q8_0-2l.gguf --prompt <16 bytes> --max-new-tokens 5",
                     result.stdout, re.M), result.stdout
    for variant in ("ktorch", "hf_offload"):
        row = re.search(rf"^\| {variant} \| [^|]+ \| 16 \| ([0-9.]+) \| ([0-9.]+) \|", result.stdout, re.M)
        assert row is not None, result.stdout
        assert float(row.group(1)) > 0 and float(row.group(2)) > 0
    assert "decode, ktorch generate [defaults] / hf_offload:" in result.stdout
    assert not list(tmp_path.iterdir())


def test_bench_unknown_name_is_an_error():
    result = run_cli("bench", "nosuch", "--", "--help", timeout=60)
    assert result.returncode != 0
    assert "unknown benchmark 'nosuch'" in result.stderr and "e2e" in result.stderr


def test_generate_gguf_without_tokenizer_runs_on_token_ids(tmp_path):
    """A benchmark GGUF (tokenizer.ggml.model = "none") generates from the prompt's bytes as ids."""
    from ktorch.integrations.gguf_writer import write_random_qwen3moe_gguf

    path = write_random_qwen3moe_gguf(tmp_path / "bench.gguf", experts_type="Q4_0", num_layers=2, num_experts=8,
                                      experts_per_token=2, hidden_size=64, expert_intermediate_size=64, num_heads=4,
                                      num_kv_heads=2, head_dim=16, vocab_size=512, distinct_experts=2, progress=False)
    result = run_cli("generate", "--model", str(path), "--prompt", "hi", "--max-new-tokens", "4", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("[token ids] 104 105 ->") and len(result.stdout.split("->")[1].split()) == 4
    assert TIMING.search(result.stderr) and "experts gguf:Q4_0 on cpu" in result.stderr  # auto keeps the file's Q4_0 exactly


def test_generate_rejects_a_bad_model_file(tmp_path, capsys):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"not a model at all")
    assert main(["generate", "--model", str(path), "--prompt", "x"]) == 1
    err = capsys.readouterr().err
    assert f"--model {path}" in err and "not a GGUF file" in err


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_generate_on_the_gpu_captures_the_decode_step_and_matches_eager():
    """The default on a GPU (the decode step as one CUDA graph) prints the same greedy text as --no-compile, and
    says what the capture took."""
    common = ("generate", "--model", "builtin", "--prompt", "Once upon a time", "--max-new-tokens", "12",
              "--device", "cuda")
    graphs = run_cli(*common, timeout=600)
    assert graphs.returncode == 0, graphs.stderr
    assert TIMING.search(graphs.stderr) and graphs.stdout.strip()
    assert "decode-step capture" in graphs.stderr
    eager = run_cli(*common, "--no-compile", timeout=600)
    assert eager.returncode == 0, eager.stderr
    assert eager.stdout == graphs.stdout


def test_defaults_are_the_fast_path():
    """No option is needed for the fast path: decode-step capture is on unless --no-compile, and experts stream to
    the GPU at prefill and fill its memory as residents (both auto) where there is one; on the CPU both resolve to off
    and capture does not apply."""
    from ktorch.cli import load_model

    args = build_parser().parse_args(["generate", "--prompt", "x", "--device", "cpu"])
    assert args.no_compile is False and args.stream_experts is None and args.gpu_memory is None
    model, _, device = load_model(args)
    assert device.type == "cpu" and args.stream_experts == "off" and args.gpu_memory == "off"
    assert all(getattr(m, "kt_stream_plan", None) is None for m in model.modules())


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_gpu_memory_defaults_to_auto_on_a_gpu_and_is_ignored_on_the_cpu(command):
    """--gpu-memory and --stream-experts unset: auto on a CUDA device (the measured fast path), off on the CPU (no
    error); --plain keeps both off; a value given stays as given (and is reported as given)."""
    import torch

    from ktorch.cli import _gpu_memory_argument, placement_defaults

    extra = ["--prompt", "x"] if command == "generate" else []
    parse = build_parser().parse_args
    for device, want in (("cuda", "auto"), ("cuda:1", "auto"), ("cpu", "off")):
        args = parse([command, *extra])
        assert args.gpu_memory is None and args.stream_experts is None
        assert placement_defaults(args, torch.device(device)) == (True, True)
        assert args.gpu_memory == want and args.stream_experts == want
        assert _gpu_memory_argument(args.gpu_memory, args.stream_experts) == want
    args = parse([command, *extra, "--gpu-memory", "off"])
    assert placement_defaults(args, torch.device("cuda")) == (True, False)
    assert args.gpu_memory == "off" and args.stream_experts == "auto"
    args = parse([command, *extra, "--gpu-memory", "24GiB", "--stream-experts", "off"])
    assert placement_defaults(args, torch.device("cpu")) == (False, False)
    assert _gpu_memory_argument(args.gpu_memory, "off") == 24 << 30
    if command != "serve":
        args = parse([command, *extra, "--plain"])
        placement_defaults(args, torch.device("cuda"))
        assert args.gpu_memory == "off" and args.stream_experts == "off"


def serve_refusal(argv: list, capsys) -> Optional[str]:
    """Where the installed transformers is one serve refuses (the device's 5.17): checks that ``main(argv)`` refuses
    before loading, saying why, and returns why (the caller skips the rest); None where serve accepts it."""
    from ktorch.serve.engine import check_transformers

    try:
        check_transformers()
    except RuntimeError as e:
        assert main(argv) == 1
        assert str(e) in capsys.readouterr().err
        return str(e)
    return None


def test_gpu_memory_default_on_the_cpu_places_nothing(capsys, monkeypatch):
    """On the CPU the defaulted --gpu-memory loads and generates without a word about it and places nothing; given
    explicitly (auto or a size) it is a clear error; off is accepted (it means none anyway). serve's engine then gets
    no pool of ktorch's sizing (its CPU default, 1 GiB) and transformers' own memory share."""
    import ktorch.serve
    from ktorch.cli import load_model

    args = build_parser().parse_args(["generate", "--prompt", "x", "--device", "cpu"])
    model, _, device = load_model(args, warm_up=False)
    assert device.type == "cpu" and args.gpu_memory == "off"
    assert getattr(model, "kt_gpu_memory", None) is None
    assert all(getattr(m, "kt_routed", None) is None for m in model.modules())
    for value in ("auto", "2GiB"):
        assert main(["generate", "--prompt", "hi", "--device", "cpu", "--gpu-memory", value]) == 1
        assert "place experts on a GPU; --device is cpu" in capsys.readouterr().err
    assert main(["generate", "--prompt", "hi", "--device", "cpu", "--gpu-memory", "off", "--max-new-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert TIMING.search(err) and "GPU memory" not in err
    configs = []
    monkeypatch.setattr(ktorch.serve, "run_server", lambda *a, **k: configs.append(k["config"]))
    refusal = serve_refusal(["serve", "--device", "cpu"], capsys)
    if refusal is not None:
        assert not configs  # refused before the server
        pytest.skip(f"serve's part: {refusal}")
    assert main(["serve", "--device", "cpu"]) == 0
    assert configs[0].num_blocks is None and configs[0].max_memory_percent is None
    assert "KV pool" not in capsys.readouterr().err
