"""The AMX gemm kernels at the kernel level (ktorch/csrc/kernels/amx/test, docs/amx.md "Checking it without AMX").

The C++ test there runs the real kernel code against a double-precision reference and the AVX-512 kernels
under the tile walk ('rows'), over the calls the fused-MoE driver makes and their edges, every M through the tiles,
and checks the walks' weight prefetches and how often int4 unpacks each weight line. Two builds:
  - emulated: a software model of the tile registers under AddressSanitizer/UBSan; needs AVX-512 BF16/VNNI
    (not AMX), so it runs in CI, where the op tests cannot reach the AMX code;
  - native: the same checks on real tiles; needs AMX granted by the OS (the device).
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess

import pytest

import ktorch

RUN_SH = pathlib.Path(__file__).resolve().parents[1] / "ktorch" / "csrc" / "kernels" / "amx" / "test" / "run.sh"


def skip_reason(mode: str) -> str | None:
    if not RUN_SH.exists():
        return f"{RUN_SH} is not in this checkout (installed without the sources)"
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        return "no C++ compiler (g++ or $CXX) to build the kernel test"
    features = ktorch.cpu_features()
    if mode == "emulated" and not (features["avx512_bf16"] and features["avx512_vnni"]):
        return "emulated AMX test: this CPU lacks AVX-512 BF16/VNNI"
    if mode == "native" and "amx" not in features["available"]:
        return f"native AMX test: this CPU/OS offers no AMX (available: {','.join(features['available'])})"
    return None


# (the emulated build runs ~2 minutes alone on one core, longer beside other tests: past the device's default
# per-test limit of 240 s under xdist; the mark is read where pytest-timeout is installed)
@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", ["emulated", "native"])
def test_amx_kernels_against_reference(mode, tmp_path):
    reason = skip_reason(mode)
    if reason:
        pytest.skip(reason)
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.run(["bash", str(RUN_SH), mode], capture_output=True, text=True, timeout=900, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "FAIL" not in out, out[-4000:]
    m = re.search(r"^walk default\s+(\d+) cases, (\d+) failed$", out, re.MULTILINE)
    assert m is not None, f"no result line for the walks:\n{out[-4000:]}"
    assert int(m.group(1)) > 1000 and int(m.group(2)) == 0, m.group(0)
    total = re.search(r"^(\d+) cases, 0 failed$", out, re.MULTILINE)
    assert total is not None and int(total.group(1)) > 1000, out[-2000:]
