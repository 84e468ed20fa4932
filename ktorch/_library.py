"""Loading the compiled ``kt`` op library and reporting what the CPU can run."""

from __future__ import annotations

import glob
import os

import torch

_LOADED = False


def load_library() -> None:
    """Loads ktorch/_C*.so (op registrations only, no Python module) into torch.ops.kt, once."""
    global _LOADED
    if _LOADED:
        return
    here = os.path.dirname(os.path.abspath(__file__))
    candidates = sorted(glob.glob(os.path.join(here, "_C*.so")))
    if not candidates:
        raise ImportError(
            f"ktorch's compiled extension (ktorch/_C*.so) was not found in {here}; "
            "build it with `pip install --no-build-isolation -e .`"
        )
    torch.ops.load_library(candidates[0])
    _LOADED = True


def cpu_features() -> dict:
    """What this CPU offers and which kernel level ``kt.fused_moe`` will run.

    Returns a dict with the vendor, the ISA flags (avx2, fma, avx512f, avx512_bf16, avx512_vnni, amx_bf16, amx_int8,
    os_amx, ...), ``available`` (the kernel levels this machine can run) and ``kernel`` (the level a call
    runs at now: the best available unless ``KT_CPU_KERNEL`` / ``ktorch.config.set_cpu_kernel`` forces one).
    """
    info: dict = {}
    for line in torch.ops.kt.cpu_info():
        key, value = line.split("=", 1)
        info[key] = value == "1" if value in ("0", "1") else value
    info["available"] = info["available"].split(",")
    info["kernel"] = torch.ops.kt.selected_kernel()
    return info


def get_num_threads() -> int:
    """Threads of ktorch's CPU worker pool (the calling thread included), which run ``kt.fused_moe``."""
    return int(torch.ops.kt.get_num_threads())


def set_num_threads(n: int) -> None:
    """Resizes ktorch's CPU worker pool to ``n`` threads (the calling thread included); call it between ops. The
    pool is also rebuilt at the same size when ``KT_SPIN_US`` (``ktorch.config.set_spin_us``) changed since it was
    built.

    Default: ``KT_NUM_THREADS``, else ``torch.get_num_threads()`` when the pool is first used. In hybrid
    CPU/GPU inference other threads need cores while the pool's workers spin between calls: CUDA's callback
    thread (it runs the host functions that start and join each call), the thread launching GPU work, and the
    driver's own; with every core given to spinning workers one of them is descheduled and calls stretch to
    scheduler time slices (~2 ms stalls). ``ktorch.prepare(..., device="cuda")`` therefore leaves
    ``HYBRID_SPARE_CORES`` (3) cores free unless ``KT_NUM_THREADS`` is set or this function was called: on the
    16-core device, 13 pool threads decoded 8-25% faster than 15, with 5-10x fewer gaps over 1 ms between calls
    (benchmarks/RESULTS.md, "Decode overheads A/B"); decode is memory-bound, so 13 threads still read at the
    DRAM limit."""
    global _threads_chosen
    if n < 1:
        raise ValueError(f"set_num_threads: need at least 1 thread, got {n}")
    torch.ops.kt.set_num_threads(int(n))
    _threads_chosen = True


_threads_chosen = False  # set by set_num_threads: a size the user chose is never changed behind their back


HYBRID_SPARE_CORES = 3  # cores a hybrid placement leaves to CUDA's callback thread, the launcher and the driver


def leave_cores_for_the_gpu_side() -> None:
    """Hybrid CPU/GPU placement: HYBRID_SPARE_CORES pool threads fewer than torch's (at least 1), unless the size
    was chosen (KT_NUM_THREADS or set_num_threads)."""
    if not _threads_chosen and not torch.ops.kt.get_option("KT_NUM_THREADS"):
        torch.ops.kt.set_num_threads(max(1, torch.get_num_threads() - HYBRID_SPARE_CORES))
