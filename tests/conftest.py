"""Fixtures shared by the op tests: the kernel level to run at, and a fresh random seed per test.

Every test draws a new seed (from os.urandom) and seeds torch with it, so each run tries new inputs; a
failing test's report carries the seed, and KT_TEST_SEED=<seed> replays exactly those inputs.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest
import torch

import ktorch

def _threads_per_xdist_worker() -> None:
    """Under pytest-xdist every worker process would size torch's pool (and ktorch's, which follows it) to every
    core: `-n 14` on the device's 16 cores ran 14 x 16 threads, and float64 tests crawled (a third of 11 files in
    330 s). Each worker gets its share of the cores, at least 2 so that the multi-threaded paths still run (on CI's 2
    cores with -n 2: 2, as before)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ and "KT_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(2, len(os.sched_getaffinity(0)) // workers))


_threads_per_xdist_worker()

KERNEL_LEVELS = ("portable", "avx2", "avx512", "amx")
BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load_benchmark(name: str):
    """benchmarks/<name>.py as a module. The folder goes on sys.path, as when a script runs from it: the benchmarks
    import each other by name."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)

# What each level needs from the CPU, in words for the skip reason.
_LEVEL_NEEDS = {
    "avx2": ("AVX2 and FMA", ("avx2", "fma", "os_avx")),
    "avx512": ("AVX-512 BF16/VNNI", ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "os_avx512")),
    "amx": ("AMX", ("amx_tile", "amx_bf16", "amx_int8", "os_amx")),
}


def kernel_skip_reason(level: str) -> str | None:
    """Why this machine cannot run `level`, or None when it can."""
    features = ktorch.cpu_features()
    available = ",".join(features["available"])
    if level in features["available"]:
        return None
    what, flags = _LEVEL_NEEDS[level]
    if not all(features.get(flag) for flag in flags):
        return f"{level}: this CPU lacks {what} (available: {available})"
    return f"{level}: the CPU has {what} but ktorch offers no {level} kernels yet (available: {available})"


# What the driver-only test files (NUMA split, GLU epilogues, backward) set as SKIP_KERNEL_LEVELS: avx2 shares the
# code they test with portable (the driver), and its gemms are checked by the op tests (test_ops_fused_moe,
# test_ops_kquant, test_ops_mxfp4); skipping it there saves CI ~3 minutes.
DRIVER_ONLY_SKIPS = {
    "avx2": "avx2: this file tests the driver, which avx2 shares with portable (its gemms: the op tests)"}


@pytest.fixture(params=KERNEL_LEVELS)
def kernel(request, monkeypatch) -> str:
    """Runs the test with KT_CPU_KERNEL forced to each level; skips the levels this machine lacks, and those the test's
    module names in SKIP_KERNEL_LEVELS ({level: why})."""
    level = request.param
    reason = kernel_skip_reason(level) or getattr(request.module, "SKIP_KERNEL_LEVELS", {}).get(level)
    if reason is not None:
        pytest.skip(reason)
    monkeypatch.setenv("KT_CPU_KERNEL", level)
    assert torch.ops.kt.selected_kernel() == level
    return level


@pytest.fixture(autouse=True)
def seed(request) -> int:
    """A fresh seed for torch's global generator (or KT_TEST_SEED), recorded on the test's report."""
    forced = os.environ.get("KT_TEST_SEED")
    value = int(forced) if forced else int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(value)
    request.node.user_properties.append(("seed", value))
    return value


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        seeds = [v for k, v in item.user_properties if k == "seed"]
        if seeds:
            report.sections.append(("seed", f"seed={seeds[0]}: rerun with KT_TEST_SEED={seeds[0]}"))


def pytest_runtest_logreport(report):
    """With KT_FAILURES_LOG=<file>, each failure's report (seed included) is appended there as it happens, so a run
    cut off by a time limit (the device's calls are) still leaves the tracebacks of what failed before the cut."""
    path = os.environ.get("KT_FAILURES_LOG")
    # under pytest-xdist the controller sees each worker's report again (report.node): the worker wrote it already
    if path and report.failed and getattr(report, "node", None) is None:
        seed = "".join(f"\n{content}" for name, content in report.sections if name == "seed")
        with open(path, "a") as f:
            f.write(f"==== {report.nodeid} ({report.when}){seed}\n{report.longreprtext}\n\n")
