"""Host functions on a CUDA stream (``cuLaunchHostFunc``), from Python, so they can be captured in CUDA graphs.

A host function runs on a CUDA driver thread when the stream reaches it, after everything enqueued before it
and before everything after it; inside a stream capture it becomes a host node of the graph, replayed at its
place with no Python on the launching thread. ktorch uses two per routed-experts call under CUDA graphs:
one starts the CPU task once the hidden states are in pinned memory, one holds the stream until the task is
done (see experts_runtime.py). This is the Python stand-in for a C++ ``kt.submit``/``kt.wait`` op pair: each
call here acquires the GIL on the driver thread.

A host function must not call the CUDA API. The callbacks passed here only touch Python threading objects.
"""

from __future__ import annotations

import ctypes
import traceback
from typing import Callable

import torch

_HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_launch_host_func = None


def launch_native(fn_ptr: int, user_data: int, stream: torch.cuda.Stream | None = None) -> None:
    """Enqueues the C function at address ``fn_ptr`` (``void fn(void*)``) with ``user_data`` on ``stream``
    (default: the current stream), captured if the stream is capturing. A C function from ktorch's host tasks
    (runtime/host_tasks.cpp) runs with no Python and no GIL; HostFunction passes its ctypes trampoline."""
    global _launch_host_func
    if _launch_host_func is None:
        fn = ctypes.CDLL("libcuda.so.1").cuLaunchHostFunc
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        _launch_host_func = fn
    stream = torch.cuda.current_stream() if stream is None else stream
    status = _launch_host_func(ctypes.c_void_p(stream.cuda_stream), ctypes.c_void_p(fn_ptr), ctypes.c_void_p(user_data))
    if status != 0:
        raise RuntimeError(f"cuLaunchHostFunc failed with CUresult {status}")


class HostFunction:
    """A Python callable made launchable on CUDA streams; keep the object alive as long as any graph using it."""

    def __init__(self, fn: Callable[[], None]):
        self._fn = fn

        def trampoline(_user_data):
            try:
                fn()
            except BaseException as e:  # an exception cannot cross the driver thread: record it, say it
                self.error = e
                traceback.print_exc()

        self.error = None
        self._c_fn = _HOST_FN(trampoline)

    def launch(self, stream: torch.cuda.Stream | None = None) -> None:
        """Enqueues the function on ``stream`` (default: the current stream), captured if the stream is capturing."""
        launch_native(ctypes.cast(self._c_fn, ctypes.c_void_p).value, 0, stream)


# CUDA driver context scheduling flags (cuda.h CUctx_flags)
_CTX_SCHED = {"auto": 0x0, "spin": 0x1, "yield": 0x2, "block": 0x4}
_CTX_SCHED_MASK = 0x7


def set_context_sync(mode: str) -> bool:
    """How the launching thread waits for the GPU (``torch.cuda.synchronize``, a ``.item()``, a blocking copy) on
    the current device's context: "block" (sleep until woken: frees a core for the CPU experts), "spin" (CUDA's
    default with fewer contexts than cores: lowest latency, one core busy for the whole wait), "yield" or "auto".

    Uses ``cuCtxSetFlags`` (CUDA 12.1+ drivers), which changes the flags of a context already in use. Returns
    False where the driver does not offer it (the context keeps its flags)."""
    if mode not in _CTX_SCHED:
        raise ValueError(f"CUDA context sync mode must be one of {sorted(_CTX_SCHED)}, got {mode!r}")
    torch.cuda.init()
    torch.cuda.current_stream()  # makes the device's primary context current on this thread
    lib = ctypes.CDLL("libcuda.so.1")
    if not hasattr(lib, "cuCtxSetFlags") or not hasattr(lib, "cuCtxGetFlags"):
        return False
    flags = ctypes.c_uint(0)
    if lib.cuCtxGetFlags(ctypes.byref(flags)) != 0:
        return False
    new = (flags.value & ~_CTX_SCHED_MASK) | _CTX_SCHED[mode]
    return lib.cuCtxSetFlags(ctypes.c_uint(new)) == 0


def context_sync() -> str:
    """The scheduling flag of the current device's context ("auto", "spin", "yield", "block"), or "unknown"."""
    lib = ctypes.CDLL("libcuda.so.1")
    flags = ctypes.c_uint(0)
    if not hasattr(lib, "cuCtxGetFlags") or lib.cuCtxGetFlags(ctypes.byref(flags)) != 0:
        return "unknown"
    return {v: k for k, v in _CTX_SCHED.items()}.get(flags.value & _CTX_SCHED_MASK, "unknown")
