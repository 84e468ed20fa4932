"""benchmarks/bench_fused_moe.py's --pages: the ktorch rows' random packed weights are allocated as ktorch's pack ops
allocate them (advised onto transparent huge pages before the first touch: the mapping carries the kernel's "hg"
flag) or, with "4k", left to the allocator; both are valid packed layers of the asked shape."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ktorch
from conftest import load_benchmark

bench = load_benchmark("bench_fused_moe")


def vm_flags(t: torch.Tensor) -> set[str]:
    """The VmFlags of the mapping holding byte 2 MiB + 1 of t (inside the 2 MiB-aligned part that madvise covers)."""
    addr, inside = t.data_ptr() + (2 << 20) + 1, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("VmFlags:"):
                return set(line.split()[1:])
    pytest.fail("no mapping holds the tensor's bytes")


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists(),
                    reason="this kernel has no transparent huge pages (madvise sets no flag)")
@pytest.mark.parametrize("fmt", ["int8", "bf16"])
def test_pages_of_random_packed_weights(fmt, monkeypatch):
    monkeypatch.delenv("KT_HUGE_PAGES", raising=False)
    E, H, I = 8, 2048, 2560  # w13 above glibc's largest mmap threshold (32 MiB): a fresh mapping of its own
    layers = {pages: bench.random_packed(E, H, I, fmt, pages=pages) for pages in ("huge", "4k")}
    for layer in layers.values():
        assert layer.format == fmt and layer.w13.shape[0] == E and layer.w13.is_contiguous()
        out = ktorch.fused_moe(torch.randn(3, H, dtype=torch.bfloat16), torch.tensor([[0, 1], [2, 3], [7, 0]]),
                               torch.full((3, 2), 0.5), layer)
        assert out.shape == (3, H) and bool(torch.isfinite(out).all())
    assert "hg" in vm_flags(layers["huge"].w13)
    assert "hg" not in vm_flags(layers["4k"].w13)


def test_bad_pages_name():
    with pytest.raises(ValueError, match="pages must be 'huge' or '4k'"):
        bench.weights_buffer((4, 4), torch.int8, "2m")


def test_fill_parallel_covers_every_element_reproducibly(monkeypatch):
    """The benchmark's parallel random fill (one generator a piece): every element drawn from the asked range (none
    left as the buffer's initial value), the same weights for the same seed and thread count, and pieces that are
    not copies of each other."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    n = 4 * (1 << 20) + 3  # four pieces, the last one longer
    fills = []
    for _ in range(2):
        torch.manual_seed(7)
        t = torch.full((n,), 100, dtype=torch.int8)
        fills.append(bench.fill_parallel(t, lambda p, g: p.random_(-32, 32, generator=g)))
    a, b = fills
    assert torch.equal(a, b)
    assert int(a.min()) >= -32 and int(a.max()) <= 31 and not (a == 100).any()
    quarter = n // 4
    pieces = [a[i * quarter:(i + 1) * quarter] for i in range(4)]
    assert all(not torch.equal(pieces[0], p) for p in pieces[1:])
    counts = torch.bincount(a.long() + 32, minlength=64).double()
    assert counts.min() > 0.9 * n / 64 and counts.max() < 1.1 * n / 64  # uniform over the range
    torch.manual_seed(8)
    c = bench.fill_parallel(torch.empty(n, dtype=torch.int8), lambda p, g: p.random_(-32, 32, generator=g))
    assert not torch.equal(a, c)
