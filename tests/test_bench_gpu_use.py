"""benchmarks/gpu_use.py on the CPU: the GPU-in-use monitor the budget comparisons read (issue 36) reports the peak
of what nvidia-smi shows while a process runs, less what was in use before, and claims nothing without nvidia-smi."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

from conftest import load_benchmark

gpu_use = load_benchmark("gpu_use")


def _fake_smi(tmp_path, values):
    """An ``nvidia-smi`` that prints the next of ``values`` (MiB) at each call, then the last one again; it checks
    that it is asked for memory.used in MiB without units for one GPU."""
    state = tmp_path / "calls"
    state.write_text("0")
    script = tmp_path / "nvidia-smi"
    script.write_text(f"""#!{sys.executable}
import sys
args = sys.argv[1:]
assert args[:2] == ["--query-gpu=memory.used", "--format=csv,noheader,nounits"] and args[2] == "-i", args
values = {list(values)!r}
n = int(open({str(state)!r}).read())
open({str(state)!r}, "w").write(str(n + 1))
print(values[min(n, len(values) - 1)])
""")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def test_the_peak_less_the_baseline_while_a_process_runs(tmp_path, monkeypatch):
    smi = _fake_smi(tmp_path, [512, 700, 24000, 24576, 1000])
    with gpu_use.GpuUse(interval=0.05, sample=lambda: gpu_use.nvidia_smi_used_mib(smi=smi)) as use:
        subprocess.run([sys.executable, "-c", "import time; time.sleep(0.6)"], check=True)
    assert use.baseline_mib == 512 and use.peak_mib == 24576 and use.samples >= 4
    assert abs(use.peak_gib - (24576 - 512) / 1024) < 1e-9


def test_the_path_and_the_visible_device(tmp_path, monkeypatch):
    smi = _fake_smi(tmp_path, [3072])
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert gpu_use.gpu_index() == "2" and gpu_use.nvidia_smi_used_mib() == 3072
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert gpu_use.gpu_index() == "0"
    del smi


def test_no_nvidia_smi_claims_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no nvidia-smi
    assert gpu_use.nvidia_smi_used_mib() is None
    with gpu_use.GpuUse(interval=0.01) as use:
        pass
    assert use.peak_gib is None and use.samples == 0
    failing = tmp_path / "nvidia-smi"  # present but failing (no driver): nothing either
    failing.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    failing.chmod(0o755)
    assert gpu_use.nvidia_smi_used_mib() is None
