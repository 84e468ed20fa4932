"""Packed expert weights on transparent huge pages (runtime/memory.h): the pack ops and the loaders allocate them
advised (madvise MADV_HUGEPAGE before the first touch) unless KT_HUGE_PAGES=0; the bytes are the same either way
(tests/test_ops_pack.py checks them against the reference with the default on)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.library import opcheck

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    try:
        return THP.read_text().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


needs_madvise_thp = pytest.mark.skipif(thp_mode() not in ("madvise", "always"),
                                       reason=f"transparent huge pages are {thp_mode() or 'absent'} on this kernel")


_SCRIPT = """
import torch, ktorch

def huge_kib(t):  # AnonHugePages of the mappings that overlap t's bytes (madvise splits the one it advises)
    first, end, inside, out = t.data_ptr(), t.data_ptr() + t.nbytes, False, 0
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < end and first < hi
        elif inside and line.startswith("AnonHugePages:"):
            out += int(line.split()[1])
    return out

torch.manual_seed(0)
# every packed tensor over 32 MiB (glibc's largest mmap threshold): fresh mmaps, never heap memory an earlier
# tensor touched (on small pages already: advice before the first touch is what takes effect)
E, H, I = 8, 2048, 2560  # int8: w13 80 MiB, w2 40 MiB
packed = ktorch.pack_experts(torch.randn(E, 2 * I, H) * 0.05, torch.randn(E, H, I) * 0.05, "int8")
split = ktorch.pack_experts(gate_proj=torch.randn(E, I, H) * 0.05, up_proj=torch.randn(E, I, H) * 0.05,
                            down_proj=torch.randn(E, H, I) * 0.05, dtype="bf16")
print(huge_kib(packed.w13), huge_kib(packed.w2), huge_kib(split.w13))
"""


def run(env: dict) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("KT_HUGE_PAGES", "THP_MEM_ALLOC_ENABLE")}
    return subprocess.run([sys.executable, "-c", _SCRIPT], env={**clean, **env}, capture_output=True, text=True,
                          timeout=300)


@needs_madvise_thp
def test_packed_weights_land_on_huge_pages():
    r = run({})
    assert r.returncode == 0, r.stderr
    w13, w2, split_w13 = (int(x) for x in r.stdout.split())
    # all but the unaligned ends (< 4 MiB a tensor) on huge pages, unless the kernel ran out of free huge pages
    # (it then falls back to small pages quietly): at least half of each on a machine with memory to spare
    assert w13 >= 40 << 10 and w2 >= 20 << 10 and split_w13 >= 40 << 10, r.stdout


@pytest.mark.skipif(thp_mode() != "madvise", reason="only under THP 'madvise' does the advice alone decide")
def test_huge_pages_off():
    r = run({"KT_HUGE_PAGES": "0"})
    assert r.returncode == 0, r.stderr
    assert [int(x) for x in r.stdout.split()] == [0, 0, 0]


def test_huge_pages_rejects_other_values():
    r = run({"KT_HUGE_PAGES": "2"})
    assert r.returncode != 0 and "KT_HUGE_PAGES must be 0 or 1, got '2'" in r.stderr


def test_opcheck_advise_huge_pages():
    opcheck(torch.ops.kt.advise_huge_pages, (torch.empty(3 << 20, dtype=torch.int8),))
    opcheck(torch.ops.kt.advise_huge_pages, (torch.empty(0),))
