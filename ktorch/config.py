"""ktorch's settings: what a user or a deployment chooses, in one typed place.

Each setting is an environment variable and a function here (the value a function sets overrides the variable
until it is set back to None). Values are read where they are used, so a process may change them between calls:

=================  ==================================  =========================================================
variable           Python                              meaning (default)
=================  ==================================  =========================================================
KT_NUM_THREADS     ``ktorch.set_num_threads(n)``       ktorch's CPU worker pool size, the calling thread included
                                                       (``torch.get_num_threads()``; three fewer after
                                                       ``ktorch.prepare(..., device="cuda")``)
KT_SPIN_US         ``set_spin_us(us)``                 how long idle pool workers spin before they park, in us
                                                       (2000; 0 parks them at once); applied when the pool is
                                                       built or resized (``ktorch.set_num_threads``)
KT_CPU_KERNEL      ``set_cpu_kernel(level)``           the kernel level: auto, portable, avx2, avx512 or amx (auto:
                                                       the best this CPU/OS can run; an unavailable one is an error)
KT_HUGE_PAGES      ``set_huge_pages(on)``              packed expert weights advised onto transparent huge pages
                                                       (1; 0: ordinary 4 KiB pages)
KT_PROFILE         ``set_profile(on)``                 each ``fused_moe`` call's phase times on stderr (0)
KT_NUMA_SPLIT      ``set_numa_split(n)``               run ``ktorch.fused_moe`` with the experts split over n NUMA
                                                       nodes, or "auto" (1: off)
KT_CUDA_SYNC       ``set_cuda_sync(mode)``             how the launching thread waits for the GPU once
                                                       ``ktorch.prepare(..., device="cuda")`` ran: block, spin,
                                                       yield, auto or keep (block)
=================  ==================================  =========================================================

These are the only environment variables the library reads (``SETTINGS``; README.md lists the same, and
tests/test_config.py checks that both agree with the code). Tuning values of the kernels and the driver (task
grids, prefetch distances, tile walks, thresholds) are constants in the C++ code, each beside the device
measurement that chose it; benchmarks' own switches live in ``benchmarks/``.
"""

from __future__ import annotations

import os
from typing import Optional, Union

import torch

# Read by the C++ side (runtime/config.cpp), which holds the values set from Python for them.
_CPP_SETTINGS = ("KT_NUM_THREADS", "KT_SPIN_US", "KT_CPU_KERNEL", "KT_HUGE_PAGES", "KT_PROFILE")
# Read here, in Python.
_PY_SETTINGS = ("KT_NUMA_SPLIT", "KT_CUDA_SYNC")
SETTINGS = _CPP_SETTINGS + _PY_SETTINGS

_py_values: dict[str, str] = {}  # the Python-read settings' values set from Python

CPU_KERNELS = ("auto", "portable", "avx2", "avx512", "amx")
CUDA_SYNC_MODES = ("block", "spin", "yield", "auto", "keep")


def value(name: str) -> Optional[str]:
    """The setting's value in effect: set from Python, else the environment variable's; None when neither (or
    empty)."""
    if name in _PY_SETTINGS:
        v = _py_values.get(name) or os.environ.get(name, "")
        return v.strip() or None
    if name in _CPP_SETTINGS:
        return torch.ops.kt.get_option(name)
    raise ValueError(f"ktorch.config: {name!r} is not one of ktorch's settings {SETTINGS}")


def _set(name: str, v: Optional[str]) -> None:
    if name in _PY_SETTINGS:
        if v is None:
            _py_values.pop(name, None)
        else:
            _py_values[name] = v
    else:
        torch.ops.kt.set_option(name, v)


def _flag(name: str, on: Optional[bool]) -> None:
    if on is not None and not isinstance(on, bool):
        raise TypeError(f"{name}: expected True, False or None, got {on!r}")
    _set(name, None if on is None else str(int(on)))


def set_spin_us(us: Optional[int]) -> None:
    """``KT_SPIN_US``: how long idle pool workers spin before they park, in microseconds (None: the variable's, else
    2000). Applied when the pool is next built or resized (``ktorch.set_num_threads`` rebuilds it at the same size
    when this changed)."""
    if us is not None and (isinstance(us, bool) or not isinstance(us, int) or us < 0):
        raise ValueError(f"KT_SPIN_US: expected microseconds >= 0 or None, got {us!r}")
    _set("KT_SPIN_US", None if us is None else str(us))


def set_cpu_kernel(level: Optional[str]) -> None:
    """``KT_CPU_KERNEL``: the kernel level every later call runs at: "auto" (the best available), "portable",
    "avx2", "avx512" or "amx" (an unavailable one is an error at the next call); None: the variable's, else auto."""
    if level is not None and level not in CPU_KERNELS:
        raise ValueError(f"KT_CPU_KERNEL must be one of {', '.join(CPU_KERNELS)}; got {level!r}")
    _set("KT_CPU_KERNEL", level)


def set_huge_pages(on: Optional[bool]) -> None:
    """``KT_HUGE_PAGES``: whether packed expert weights are advised onto transparent huge pages (default True:
    1-3% faster decode layers on the device); None: the variable's."""
    _flag("KT_HUGE_PAGES", on)


def set_profile(on: Optional[bool]) -> None:
    """``KT_PROFILE``: whether each ``fused_moe`` call prints its phase times to stderr (default False)."""
    _flag("KT_PROFILE", on)


def set_numa_split(n: Union[int, str, None]) -> None:
    """``KT_NUMA_SPLIT``: ``ktorch.fused_moe`` runs a plain ``PackedExperts`` split over n NUMA nodes (n >= 1, or
    "auto": one slice per node with CPUs); 1 or None (and the variable unset): off."""
    if n is not None and n != "auto" and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"KT_NUMA_SPLIT must be 'auto' or a positive integer, got {n!r}")
    _set("KT_NUMA_SPLIT", None if n is None else str(n))


def set_cuda_sync(mode: Optional[str]) -> None:
    """``KT_CUDA_SYNC``: how the launching thread waits for the GPU, applied by the next ``ktorch.prepare(...,
    device="cuda")``: "block" (default: it sleeps, leaving its core to the experts' workers), "spin", "yield",
    "auto" (CUDA's choice by core count) or "keep" (leave the context as it is)."""
    if mode is not None and mode not in CUDA_SYNC_MODES:
        raise ValueError(f"KT_CUDA_SYNC must be one of {', '.join(CUDA_SYNC_MODES)}; got {mode!r}")
    _set("KT_CUDA_SYNC", mode)


def options() -> dict:
    """Every setting's value in effect (None where neither Python nor the environment set it)."""
    return {name: value(name) for name in SETTINGS}
