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
