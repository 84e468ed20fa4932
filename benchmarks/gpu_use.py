"""What a process really takes of the GPU, as the card's owner sees it: ``nvidia-smi``'s memory in use on the device,
sampled on a thread while a benchmarked process runs (``ktorch generate``, ``llama-bench``).

A GPU-budget comparison (issue 36: "a 24 GiB budget ... llama.cpp: the ``--n-cpu-moe N`` that fits 24 GiB, with a
check of its real GPU use") needs one measure for both sides. The allocator's peak that ``ktorch generate`` prints
leaves out the CUDA context, the loaded kernels and the allocator's cached blocks, and llama.cpp prints no total;
nvidia-smi's ``memory.used`` holds all of it, for every process on the device, so the figure kept is the peak over
the run minus what was in use before it started (another process's memory is not counted, if it does not change).

    with GpuUse() as use:
        subprocess.run(...)
    use.peak_gib   # None without nvidia-smi (a CPU machine): nothing is claimed

Sampling costs one nvidia-smi process every ``interval`` seconds (~20-40 ms of one core each): 1 s by default, as
the memory of both programs grows at load and stays (neither frees its weights or graphs before exiting).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from typing import Callable, Optional

MIB = 1 << 20
GIB = 1 << 30


def gpu_index() -> str:
    """The device nvidia-smi should read: the first of ``CUDA_VISIBLE_DEVICES`` (what a CUDA process uses as its
    device 0), else 0."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return visible or "0"


def nvidia_smi_used_mib(index: Optional[str] = None, smi: Optional[str] = None) -> Optional[int]:
    """``memory.used`` of GPU ``index`` in MiB by nvidia-smi; None where there is none (or it fails)."""
    smi = smi or shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i",
                              index or gpu_index()], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    try:
        return int(out.stdout.strip().splitlines()[0])
    except (ValueError, IndexError):
        return None


class GpuUse:
    """A context manager sampling the GPU's memory in use (``sample()``, default nvidia-smi in MiB) every
    ``interval`` seconds while open, and once more when closed: ``baseline_mib`` (before), ``peak_mib`` (the
    largest sample), ``samples``; ``peak_gib`` the peak less the baseline in GiB (None where nothing could be
    read)."""

    def __init__(self, interval: float = 1.0, sample: Optional[Callable[[], Optional[int]]] = None):
        self.interval = interval
        self.sample = sample or nvidia_smi_used_mib
        self.baseline_mib: Optional[int] = None
        self.peak_mib: Optional[int] = None
        self.samples = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _take(self) -> None:
        used = self.sample()
        if used is None:
            return
        self.samples += 1
        self.peak_mib = used if self.peak_mib is None else max(self.peak_mib, used)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._take()

    def __enter__(self) -> "GpuUse":
        self.baseline_mib = self.sample()
        if self.baseline_mib is not None:  # nothing to read: no thread
            self._thread = threading.Thread(target=self._run, name="gpu-use", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._take()

    @property
    def peak_gib(self) -> Optional[float]:
        if self.baseline_mib is None or self.peak_mib is None:
            return None
        return max(self.peak_mib - self.baseline_mib, 0) * MIB / GIB
