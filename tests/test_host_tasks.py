"""Native host tasks (runtime/host_tasks.cpp): the C start/join functions that CUDA host functions call under
CUDA graphs with KT_HOST_FUNCTIONS=native. Here they are called directly (as CUDA's callback thread would), on
the CPU, against kt.fused_moe."""

from __future__ import annotations

import ctypes
import threading
import types

import pytest
import torch

import ktorch
from ktorch.compile.experts_runtime import ExpertsLayer, ExpertsRuntime, _NativeHostFunctions, native_host_tasks

_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def make_task(seed: int, T: int = 7, E: int = 6, H: int = 128, I: int = 64, fmt: str = "int8"):
    torch.manual_seed(seed)
    packed = ktorch.pack_experts(torch.randn(E, 2 * I, H) * 0.05, torch.randn(E, H, I) * 0.05, fmt)
    w13, s13, w2, s2 = packed.tensors()
    layer = ExpertsLayer(w13, s13, w2, s2, "silu")
    staging = types.SimpleNamespace(hidden=torch.randn(T, H), topk_ids=torch.randint(-1, E, (T, 3)),
                                    topk_weights=torch.rand(T, 3), out=torch.zeros(T, H))
    return staging, layer, packed


def expected(staging, packed):
    """What the task runs: the op itself (not ktorch.fused_moe, which KT_NUMA_SPLIT may route to the split)."""
    return torch.ops.kt.fused_moe(staging.hidden, staging.topk_ids, staging.topk_weights, *packed.tensors(), "silu")


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_run_matches_the_op_and_reuses_its_buffers(fmt):
    staging, layer, packed = make_task(1, fmt=fmt)
    task = _NativeHostFunctions(staging, layer)
    for step in range(3):  # like graph replays: new values copied into the same staging tensors
        staging.hidden.copy_(torch.randn_like(staging.hidden))
        staging.topk_ids.copy_(torch.randint(-1, 6, staging.topk_ids.shape))
        task.run()
        assert torch.equal(staging.out, expected(staging, packed)), f"step {step}"
    assert task.error() == ""


def test_start_and_join_from_other_threads():
    """start on one thread, join on another (CUDA's callback thread runs both, in stream order)."""
    staging, layer, packed = make_task(2, T=33)
    task = _NativeHostFunctions(staging, layer)
    start = _FN(task[0].ptr)
    join = _FN(task[1].ptr)
    for _ in range(5):
        staging.out.zero_()
        t = threading.Thread(target=start, args=(task.handle,))
        t.start()
        t.join()
        j = threading.Thread(target=join, args=(task.handle,))
        j.start()
        j.join(timeout=30)
        assert not j.is_alive()
        assert torch.equal(staging.out, expected(staging, packed))


def test_failure_gives_nan_and_a_message(capfd):
    staging, layer, _ = make_task(3)
    staging.topk_ids[0, 0] = 99  # out of range for 6 experts
    task = _NativeHostFunctions(staging, layer)
    task.run()
    assert torch.isnan(staging.out).all()
    assert "out of range for 6 experts" in task.error()
    assert "host-task worker" in capfd.readouterr().err


def test_timeline_is_recorded_and_drained():
    staging, layer, _ = make_task(4)
    runtime = ExpertsRuntime()
    task = _NativeHostFunctions(staging, layer)
    runtime._native_tasks.append(task)
    for _ in range(3):
        task.run()
    timeline = runtime.take_native_timeline()
    assert len(timeline) == 3 and all(s <= e and n == staging.hidden.shape[0] for s, e, n in timeline)
    assert runtime.take_native_timeline() == []


def test_bad_staging_is_an_error():
    staging, layer, _ = make_task(5)
    staging.out = torch.zeros(3, 3)
    with pytest.raises(RuntimeError, match="out must be a contiguous tensor like hidden"):
        _NativeHostFunctions(staging, layer)


def test_host_functions_switch(monkeypatch):
    monkeypatch.delenv("KT_HOST_FUNCTIONS", raising=False)
    assert native_host_tasks()  # the default
    monkeypatch.setenv("KT_HOST_FUNCTIONS", "python")
    assert not native_host_tasks()
    monkeypatch.setenv("KT_HOST_FUNCTIONS", "native")
    assert native_host_tasks()
    monkeypatch.setenv("KT_HOST_FUNCTIONS", "cpp")
    with pytest.raises(ValueError, match="'python' or 'native'"):
        native_host_tasks()


def test_python_host_function_address_calls_its_callable():
    """HostFunction hands CUDA the address of its ctypes trampoline; called as a C function it runs the callable."""
    from ktorch.compile.host_func import HostFunction

    hits = []
    fn = HostFunction(lambda: hits.append(1))
    _FN(ctypes.cast(fn._c_fn, ctypes.c_void_p).value)(None)
    assert hits == [1] and fn.error is None


def test_null_handle_is_an_error():
    with pytest.raises(RuntimeError, match="host task: null handle"):
        torch.ops.kt.host_task_run(0)


@pytest.mark.parametrize("variable", ["KT_JOIN_SPIN_US", "KT_SPIN_US"])
def test_bad_spin_setting_raises_when_the_task_is_made(variable):
    """The worker and the join's spin read their settings when the first task is made (a Python thread, where an
    error can raise), never first on CUDA's callback thread, where it could only abort the process."""
    import subprocess
    import sys

    code = ("import torch, ktorch, test_host_tasks as h\n"
            "from ktorch.compile.experts_runtime import _NativeHostFunctions\n"
            "staging, layer, packed = h.make_task(3)\n"
            "try:\n    _NativeHostFunctions(staging, layer)\nexcept RuntimeError as e:\n    print('raised:', e)\n")
    import os

    env = dict(os.environ, **{variable: "soon"}, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__),
                                                                            os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert f"raised: {variable} must be an integer, got 'soon'" in result.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_prepare_makes_the_launching_thread_sleep_in_cuda_waits():
    """prepare(device="cuda") sets the context's sync mode to blocking (KT_CUDA_SYNC, default "block"); "spin"
    sets CUDA's busy wait; an unknown mode is an error naming the choices."""
    import copy

    from ktorch.compile.host_func import context_sync, set_context_sync
    from models import tiny_model

    ktorch.prepare(copy.deepcopy(tiny_model("qwen3_moe")), device="cuda")
    assert context_sync() == "block"
    assert set_context_sync("spin") and context_sync() == "spin"
    assert set_context_sync("block") and context_sync() == "block"
    with pytest.raises(ValueError, match="auto"):
        set_context_sync("sleepy")
