"""ktorch's settings (ktorch/config.py, runtime/config.h): the environment variables the library reads are exactly
the ones README.md documents and ktorch.config lists, at most 8; each can be set from Python, overriding the
variable until set back to None, and a bad value is an error."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

import ktorch
from ktorch import config

ROOT = pathlib.Path(__file__).resolve().parents[1]
NAME = re.compile(r"\bKT_[A-Z0-9_]+")


def names_in_library() -> set[str]:
    """Every KT_ name in ktorch/'s sources, the AMX kernel test's folder (its own benchmark switches) left out."""
    names = set()
    for path in (ROOT / "ktorch").rglob("*"):
        if path.suffix not in (".py", ".cpp", ".h", ".cu") or "test" in path.relative_to(ROOT / "ktorch").parts:
            continue
        names |= set(NAME.findall(path.read_text()))
    return names


def names_in_readme() -> list[str]:
    """The variables of README.md's settings table (its section "Settings"), in order."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Settings", 1)[1].split("\n## ", 1)[0]
    return [m.group(1) for m in re.finditer(r"^\| `(KT_[A-Z0-9_]+)", section, re.MULTILINE)]


def test_the_library_reads_exactly_the_documented_settings():
    documented = names_in_readme()
    assert len(documented) == len(set(documented)), documented
    assert set(documented) == set(config.SETTINGS), (documented, config.SETTINGS)
    assert names_in_library() == set(config.SETTINGS), sorted(names_in_library() ^ set(config.SETTINGS))
    assert len(config.SETTINGS) <= 8


def test_kernel_level_set_from_python_overrides_the_variable(monkeypatch):
    monkeypatch.setenv("KT_CPU_KERNEL", "auto")
    best = torch.ops.kt.selected_kernel()
    try:
        config.set_cpu_kernel("portable")
        assert torch.ops.kt.selected_kernel() == "portable" and config.value("KT_CPU_KERNEL") == "portable"
        assert ktorch.cpu_features()["kernel"] == "portable"
    finally:
        config.set_cpu_kernel(None)
    assert torch.ops.kt.selected_kernel() == best and config.value("KT_CPU_KERNEL") == "auto"
    with pytest.raises(ValueError, match="KT_CPU_KERNEL must be one of auto, portable, avx2, avx512, amx; got 'sse2'"):
        config.set_cpu_kernel("sse2")
    assert torch.ops.kt.selected_kernel() == best


def test_profile_set_from_python_prints_the_phase_line(capfd, monkeypatch):
    monkeypatch.delenv("KT_PROFILE", raising=False)
    packed = ktorch.pack_experts(torch.randn(4, 64, 32) * 0.05, torch.randn(4, 32, 32) * 0.05, "int8")
    x, ids, w = torch.randn(3, 32), torch.randint(0, 4, (3, 2)), torch.rand(3, 2)
    ktorch.fused_moe(x, ids, w, packed)
    assert "kt.fused_moe " not in capfd.readouterr().err
    try:
        config.set_profile(True)
        ktorch.fused_moe(x, ids, w, packed)
        assert "kt.fused_moe " in capfd.readouterr().err
        monkeypatch.setenv("KT_PROFILE", "1")
        config.set_profile(False)  # Python's value wins over the variable's
        ktorch.fused_moe(x, ids, w, packed)
        assert "kt.fused_moe " not in capfd.readouterr().err
    finally:
        config.set_profile(None)
    with pytest.raises(TypeError, match="KT_PROFILE"):
        config.set_profile(1)


def test_huge_pages_setting_is_checked_where_read(monkeypatch):
    monkeypatch.delenv("KT_HUGE_PAGES", raising=False)
    try:
        config.set_huge_pages(False)
        assert config.value("KT_HUGE_PAGES") == "0"
        ktorch.pack_experts(torch.randn(2, 64, 32), torch.randn(2, 32, 32), "bf16")  # packs on 4 KiB pages
        torch.ops.kt.set_option("KT_HUGE_PAGES", "yes")  # (past the Python check) the C++ read rejects it
        with pytest.raises(RuntimeError, match="KT_HUGE_PAGES must be 0 or 1, got 'yes'"):
            ktorch.pack_experts(torch.randn(2, 64, 32), torch.randn(2, 32, 32), "bf16")
    finally:
        config.set_huge_pages(None)
    assert config.value("KT_HUGE_PAGES") is None


def test_numa_split_set_from_python_splits_the_call(monkeypatch):
    monkeypatch.delenv("KT_NUMA_SPLIT", raising=False)
    torch.manual_seed(0)
    packed = ktorch.pack_experts(torch.randn(4, 128, 64) * 0.05, torch.randn(4, 64, 64) * 0.05, "int8")
    x, ids, w = torch.randn(5, 64), torch.randint(0, 4, (5, 2)), torch.rand(5, 2)
    whole = ktorch.fused_moe(x, ids, w, packed)
    assert packed._numa_split_cache is None
    try:
        config.set_numa_split(2)
        split = ktorch.fused_moe(x, ids, w, packed)
        assert packed._numa_split_cache is not None and packed._numa_split_cache.num_slices == 2
    finally:
        config.set_numa_split(None)
    torch.testing.assert_close(split, whole, rtol=2e-2, atol=2e-3)
    assert config.value("KT_NUMA_SPLIT") is None
    for bad in (0, "two", 1.5, True):
        with pytest.raises(ValueError, match="KT_NUMA_SPLIT"):
            config.set_numa_split(bad)


def test_python_setters_check_their_values():
    with pytest.raises(ValueError, match="KT_SPIN_US"):
        config.set_spin_us(-1)
    with pytest.raises(ValueError, match="KT_CUDA_SYNC must be one of block, spin, yield, auto, keep"):
        config.set_cuda_sync("sleepy")
    config.set_cuda_sync("spin")
    try:
        assert config.value("KT_CUDA_SYNC") == "spin"
    finally:
        config.set_cuda_sync(None)
    with pytest.raises(ValueError, match="not one of ktorch's settings"):
        config.value("KT_DOWN_RANGES")
    assert set(config.options()) == set(config.SETTINGS)
