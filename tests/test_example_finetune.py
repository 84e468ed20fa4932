"""examples/finetune_lora.py, which the README points fine-tuners to: a two-step run on the built-in model goes end to
end (load, LoRA on attention and the experts, steps, finite held-out losses, a peft adapter written; that LoRA
lowers the held-out loss is test_lora's), and bad options stop with a message naming the option before the model
loads."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "finetune_lora.py"


def run_example(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


def test_a_short_run_writes_a_peft_adapter(tmp_path):
    out = tmp_path / "adapter"
    result = run_example("--steps", "2", "--batch", "2", "--seq", "32", "--out", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    before = re.search(r"held-out loss before: ([\d.]+)", result.stdout)
    after = re.search(r"held-out loss after: ([\d.]+)", result.stdout)
    assert before and after, result.stdout
    assert 0 < float(after.group(1)) < 20 and 0 < float(before.group(1)) < 20  # finite: no NaN from a bad setting
    assert "step 2: loss" in result.stdout
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["peft_type"] == "LORA"
    assert any(p.name.startswith("adapter_model") for p in out.iterdir())


@pytest.mark.parametrize("args,message", [
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--batch", "0"], "--batch must be >= 1, got 0"),
    (["--seq", "1"], "--seq must be >= 2 (the loss predicts each next token), got 1"),
    (["--rank", "0"], "--rank must be >= 1, got 0"),
    (["--lr", "-1"], "--lr must be > 0, got -1.0"),
    (["--held-out", "0"], "--held-out must be in (0, 1), got 0.0"),
    (["--text", "/no/such/file.txt"], "--text /no/such/file.txt: no such file"),
])
def test_bad_options_stop_before_loading(args, message, capsys, monkeypatch):
    # in this process (the example's main, as its __main__ runs it): a subprocess a case took 10-15 s of CI, importing
    # torch and peft each time; anything but the option's exit fails the test as a traceback would
    spec = importlib.util.spec_from_file_location("finetune_lora_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE), *args])
    monkeypatch.setattr(example.ktorch, "load", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(SystemExit) as stop:
        example.main()
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "loading" not in err  # the model's progress bar never started


def test_a_text_too_short_for_the_sequence_is_named(tmp_path):
    text = tmp_path / "short.txt"
    text.write_text("a few words only", encoding="utf-8")
    result = run_example("--text", str(text), "--seq", "64", "--steps", "1")
    assert result.returncode == 2
    assert re.search(rf"--text {re.escape(str(text))}: \d+ tokens leave \d+ to train on and \d+ held out "
                     r"\(--held-out 0.1\); both need more than --seq 64", result.stderr), result.stderr
