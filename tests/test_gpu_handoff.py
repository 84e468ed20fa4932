"""The GPU handoff of captured CPU experts calls (ktorch/compile/gpu_handoff.py with runtime/host_tasks.cpp): a doorbell
kernel starts the C++ worker's call, a wait kernel spins on the pinned done word the worker writes.

The kernels run on CUDA, or on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1 with Triton installed:
``TRITON_INTERPRET=1 PYTHONPATH=/path/to/triton:$PWD pytest tests/test_gpu_handoff.py``), where the real C++ worker
finishes its call while the interpreted wait kernel spins. The CUDA-graph tests (a graph of several layers'
submit/wait, ktorch.generate) need a GPU."""

from __future__ import annotations

import threading
import time
import types

import pytest
import torch

import ktorch
from ktorch.compile import gpu_handoff
from ktorch.compile.experts_runtime import (ExpertsLayer, ExpertsRuntime, _GpuHandoffTask, _HandoffSeqs,
                                            _NativeHostFunctions)
from ktorch.ops.triton_experts import interpreting

CUDA = torch.cuda.is_available()
RUNS = gpu_handoff.available()
needs_kernels = pytest.mark.skipif(
    not RUNS, reason="the handoff kernels need Triton and a CUDA GPU, or Triton's interpreter (TRITON_INTERPRET=1)")
needs_cuda = pytest.mark.skipif(not (CUDA and gpu_handoff.available() and not interpreting()),
                                reason="needs a CUDA GPU and Triton (CUDA graphs of the handoff)")
DEV = "cuda" if CUDA and not interpreting() else "cpu"  # where the kernels' device tensors live


def _pinned(t: torch.Tensor) -> torch.Tensor:
    return t.pin_memory() if DEV == "cuda" else t


def make_task(seed: int, T: int = 5, E: int = 6, H: int = 128, I: int = 64, split_d=None):
    gen = torch.Generator().manual_seed(seed)
    packed = ktorch.pack_experts(torch.randn(E, 2 * I, H, generator=gen) * 0.05,
                                 torch.randn(E, H, I, generator=gen) * 0.05, "int8")
    layer = ExpertsLayer(*packed.tensors(), "silu")
    K = 4
    staging = types.SimpleNamespace(
        hidden=_pinned(torch.randn(T, H, generator=gen)), topk_ids=_pinned(torch.randint(-1, E, (T, K), generator=gen)),
        topk_weights=_pinned(torch.rand(T, K, generator=gen)), out=_pinned(torch.zeros(T, H)))
    if split_d is not None:
        staging.deferred = torch.tensor(split_d)
        staging.out_later = _pinned(torch.zeros(T, H))
    return staging, layer, packed


def expected(staging, packed, ids=None):
    return torch.ops.kt.fused_moe(staging.hidden, staging.topk_ids if ids is None else ids, staging.topk_weights,
                                  *packed.tensors(), "silu")


def device_words():
    """The device's handoff words as the runtime makes them (the counter and the tasks' sequence words) and a pinned
    error flag."""
    return _HandoffSeqs(DEV), _pinned(torch.zeros(1, dtype=torch.int64))


@needs_kernels
def test_ring_writes_the_next_number_to_the_doorbell():
    counter = device_words()[0].counter
    seq = torch.zeros(1, dtype=torch.int64, device=DEV)
    words = gpu_handoff.new_words()
    for n in (1, 2, 3):
        gpu_handoff.ring(counter, seq, words)
        if DEV == "cuda":
            torch.cuda.synchronize()
        assert int(counter) == n and int(seq) == n and words.tolist() == [n, 0, 0]


@needs_kernels
@pytest.mark.parametrize("T", [1, 64])
def test_wait_kernel_spins_until_the_worker_is_done(T):
    """The doorbell kernel starts the real C++ worker's call; the wait kernel returns only after the worker
    published that call's number (its returns come after the call's end on the worker's own clock), with the
    result in the pinned output and no error flag."""
    staging, layer, packed = make_task(1, T=T, H=256, I=256)
    seqs, error = device_words()
    counter = seqs.counter
    task = _GpuHandoffTask(staging, layer, counter, seqs.take(), error)
    for step in range(3):
        staging.hidden.copy_(torch.randn_like(staging.hidden))
        staging.out.fill_(7.0)
        task.ring()
        task.wait(1)
        if DEV == "cuda":
            torch.cuda.synchronize()
        returned = time.perf_counter_ns()
        start, end = torch.ops.kt.host_task_take_times(task.handle)[-2:]
        assert end <= returned
        assert int(task.words[1]) == int(task.seq) == int(counter)
        assert int(error) == 0
        assert torch.equal(staging.out, expected(staging, packed)), f"step {step}"
    assert task.error() == ""


@needs_kernels
def test_wait_kernel_outlasts_a_slow_call():
    """The worker is kept busy by a long pushed call, so the rung doorbell waits and the wait kernel spins through
    it (many polls under the interpreter); it returns with the right result once the worker gets to it."""
    staging, layer, packed = make_task(2, T=3)
    seqs, error = device_words()
    counter = seqs.counter
    task = _GpuHandoffTask(staging, layer, counter, seqs.take(), error)
    busy, busy_layer, _ = make_task(3, T=2048, E=8, H=512, I=512)
    c = _NativeHostFunctions(busy, busy_layer)
    torch.ops.kt.host_task_take_times(c.handle)
    started = threading.Thread(target=lambda: torch.ops.kt.host_task_run(c.handle))
    started.start()
    time.sleep(0.002)
    task.ring()
    task.wait(1)
    if DEV == "cuda":
        torch.cuda.synchronize()
    started.join()
    (_, busy_end), (task_start, _) = (torch.ops.kt.host_task_take_times(h)[-2:] for h in (c.handle, task.handle))
    assert int(error) == 0
    assert torch.equal(staging.out, expected(staging, packed))
    if task_start < busy_end:
        pytest.skip("the busy call ended before the doorbell rang (a slow thread start); nothing was waited for")


@needs_kernels
def test_wait_kernel_waits_for_a_split_calls_deferred_part():
    from ktorch.passes.deferral import split_topk_slots

    staging, layer, packed = make_task(4, T=6, split_d=2)
    seqs, error = device_words()
    counter = seqs.counter
    task = _GpuHandoffTask(staging, layer, counter, seqs.take(), error)
    for d in (2, 0, 1):
        staging.deferred.fill_(d)
        task.ring()
        task.wait(1)
        task.wait(2)
        if DEV == "cuda":
            torch.cuda.synchronize()
        now, later = split_topk_slots(staging.topk_ids, staging.topk_weights, 4 - d)
        assert torch.equal(staging.out, expected(staging, packed, now if d else None))
        assert torch.equal(staging.out_later, expected(staging, packed, later) if d else torch.zeros_like(staging.out))
        assert int(task.words[2]) == int(task.seq) and int(error) == 0


@needs_kernels
def test_wait_kernel_gives_up_and_sets_the_error_flag():
    """A call that never finishes (no doorbell rung: the worker never runs it) ends the spin after its limit,
    with the call's number in the error flag; the runtime's check then raises instead of using the output."""
    staging, layer, _ = make_task(5)
    seqs, error = device_words()
    counter = seqs.counter
    task = _GpuHandoffTask(staging, layer, counter, seqs.take(), error)
    counter.fill_(41)
    task.seq.fill_(42)  # what a ring would have written, without the doorbell
    gpu_handoff.wait(task.seq, task.words, 1, error, limit_ns=20_000)  # 20 us (20 loads without the GPU's timer)
    if DEV == "cuda":
        torch.cuda.synchronize()
    assert int(error) == 42 and int(task.words[1]) == 0
    runtime = ExpertsRuntime()
    runtime.check_handoff()  # no flag yet: nothing to say
    runtime._handoff_error = error
    with pytest.raises(RuntimeError, match=r"did not finish within the GPU's wait limit \(call number 42\)"):
        runtime.check_handoff()


@needs_kernels
def test_wait_arguments_are_checked():
    seqs, error = device_words()
    counter = seqs.counter
    words = gpu_handoff.new_words()
    with pytest.raises(ValueError, match="part must be 1 \\(done\\) or 2"):
        gpu_handoff.wait(counter, words, 0, error)
    with pytest.raises(ValueError, match="limit_ns must be >= 1000"):
        gpu_handoff.wait(counter, words, 1, error, limit_ns=999)


@pytest.mark.skipif(not (CUDA and gpu_handoff.available() and not interpreting()), reason="needs a CUDA GPU")
def test_pageable_words_are_refused_by_the_launcher():
    """Triton's launcher asks CUDA for a pointer's device address: pinned memory has one, pageable memory is an
    error (never a kernel writing to an address the GPU cannot reach)."""
    counter = torch.zeros(1, dtype=torch.int64, device="cuda")
    seq = torch.zeros(1, dtype=torch.int64, device="cuda")
    with pytest.raises((ValueError, RuntimeError), match="cannot be accessed from Triton"):
        gpu_handoff.ring(counter, seq, torch.zeros(3, dtype=torch.int64))


@pytest.mark.skipif(gpu_handoff.triton is None or interpreting(),
                    reason="needs Triton, not its interpreter (which makes the kernels Python functions)")
def test_kernels_compile_for_the_gpu_with_system_memory_accesses():
    """The CUDA path, compiled for sm_90 here without a GPU (Triton's own compiler and ptxas): the wait polls with
    volatile loads and reads the global timer, the doorbell is written through to system memory and fenced at
    system scope, the error flag written through."""
    from sm90 import sm90_ptx

    def ptx(fn, signature, constexprs):
        return sm90_ptx(fn, signature, constexprs, num_warps=1)

    pointers = {"counter_ptr": "*i64", "seq_ptr": "*i64", "words_ptr": "*i64"}
    ring = ptx(gpu_handoff._ring_kernel, pointers, {"FENCE": True})
    assert "st.global.wt.b64" in ring and "membar.sys" in ring
    wait_sig = {"seq_ptr": "*i64", "words_ptr": "*i64", "error_ptr": "*i64", "limit": "i64"}
    for clock in (True, False):
        wait = ptx(gpu_handoff._wait_kernel, wait_sig, {"PART": 2, "CLOCK": clock})
        assert "ld.volatile.global.b64" in wait and "st.global.wt.b64" in wait
        assert ("%globaltimer" in wait) == clock


def _device_factories():
    """A dispatch mode that lists the ops which made a tensor on a CUDA device while it was open."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Factories(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.made = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            tensors = out if isinstance(out, (tuple, list)) else (out,)
            fresh = [t for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda
                     and not any(isinstance(a, torch.Tensor) and a.is_cuda and a.untyped_storage().data_ptr()
                                 == t.untyped_storage().data_ptr() for a in args)]
            if fresh:
                self.made.append(str(func))
            return out

    return Factories()


def test_captured_tasks_take_words_made_before_and_allocate_no_device_memory():
    """A staging's task is made inside a capture, where a new device tensor lands in the graph's private pool
    (cudagraph trees then refuse the graph: "tensor(s) in the cudagraph pool not tracked as outputs"). Each GPU-
    handoff task's sequence word is a view of the block _HandoffSeqs made beforehand, one word per task; once the
    block is used up, a capture's task takes host functions (no allocation), and the next eager call's top-up
    gives a later capture of that staging a handoff task again. No op makes a CUDA tensor meanwhile."""
    from ktorch.compile.experts_runtime import _Site, _Staging

    runtime = ExpertsRuntime()
    (layer,) = _layers(runtime, 1, H=64, I=32)
    device = torch.device(DEV)
    seqs = _HandoffSeqs(device, slots=4)  # the counter and 3 words
    runtime._handoff_seqs[device] = seqs  # what _prepare_handoff leaves
    runtime._handoff_error = _pinned(torch.zeros(1, dtype=torch.int64))
    block = seqs.blocks[0].untyped_storage().data_ptr()
    site = _Site()
    stagings = [_Staging.like(torch.zeros(T, 64), torch.zeros(T, 4, dtype=torch.long), torch.zeros(T, 4))
                for T in (1, 2, 3, 4)]
    factories = _device_factories()
    with factories:
        tasks = [runtime._host_functions(site, s, runtime.layers[layer], device=device) for s in stagings]
    assert factories.made == []
    assert [type(t) for t in tasks] == [_GpuHandoffTask] * 3 + [_NativeHostFunctions]
    assert runtime.stats["handoff_words_short"] == 1
    assert all(t.seq.untyped_storage().data_ptr() == block for t in tasks[:3])
    assert sorted(t.seq.storage_offset() for t in tasks[:3]) == [1, 2, 3]  # word 0 is the counter
    assert all(t.counter is seqs.counter for t in tasks[:3]) and seqs.counter.storage_offset() == 0
    assert seqs.take() is None
    runtime._prepare_handoff(device)  # an eager call: a new block
    assert len(seqs.blocks) == 2 and seqs.free() == 4
    with factories:
        again = runtime._host_functions(site, stagings[3], runtime.layers[layer], device=device)
    assert factories.made == []
    assert isinstance(again, _GpuHandoffTask) and stagings[3].host_functions is again
    assert again.seq.untyped_storage().data_ptr() == seqs.blocks[1].untyped_storage().data_ptr()
    assert runtime._host_functions(site, stagings[0], runtime.layers[layer], device=device) is tasks[0]  # kept
    with pytest.raises(ValueError, match="seq must be an int64"):
        _GpuHandoffTask(stagings[0], runtime.layers[layer], seqs.counter, seqs.blocks[1][:2], runtime._handoff_error)
    with pytest.raises(ValueError, match="a block needs at least 2 words .* got 1"):
        _HandoffSeqs(device, slots=1)


# ---------------------------------------------------------------- CUDA graphs


def _layers(runtime: ExpertsRuntime, n: int, H: int = 256, I: int = 128, E: int = 8):
    gen = torch.Generator().manual_seed(7)
    ids = []
    for _ in range(n):
        packed = ktorch.pack_experts(torch.randn(E, 2 * I, H, generator=gen) * 0.05,
                                     torch.randn(E, H, I, generator=gen) * 0.05, "int8")
        ids.append(runtime.register_layer(*packed.tensors(), "silu"))
    return ids


def _chain(runtime: ExpertsRuntime, layers, sites, hidden, topk_ids, topk_weights, d: int):
    """Several layers' submit/wait, each layer's input the last one's output plus its input (a decode step's shape),
    with deferral's pattern when d > 0 (the deferred part waited for one layer on)."""
    later = None
    x = hidden
    for i, layer in enumerate(layers):
        now_site, later_site = sites[i]
        last = i == len(layers) - 1
        if d and not last:
            ticket = runtime.submit_split(x, topk_ids, topk_weights, layer, now_site, later_site, d, join_now=True)
        else:
            ticket = runtime.submit(x, topk_ids, topk_weights, layer, now_site, join_now=True)
        out = runtime.wait(ticket, x, layer, now_site)
        if later is not None:
            out = out + runtime.wait(*later)
            later = None
        if d and not last:
            later = (ticket, x, layer, later_site)
        x = (x + out).to(hidden.dtype)
    return x


@needs_cuda
@pytest.mark.parametrize("d", [0, 2])
def test_graph_with_gpu_handoff_equals_host_functions(d):
    """A CUDA graph of several layers' submit/wait (d = 0, and deferral's split calls) with the GPU handoff gives,
    replay after replay with new inputs, bit for bit what the same graph with host functions gives, and what the
    eager calls give; the handoff graph's tasks are all GPU-handoff tasks, and no wait gave up."""
    T, H, K, n = 1, 256, 4, 6
    results = {}
    gen = torch.Generator().manual_seed(11)
    inputs = [(torch.randn(T, H, generator=gen), torch.randint(0, 8, (T, K), generator=gen),
               torch.rand(T, K, generator=gen)) for _ in range(20)]
    for handoff in (True, False):
        runtime = ExpertsRuntime()
        runtime.gpu_handoff = handoff
        layers = _layers(runtime, n, H=H)
        sites = [(runtime.new_site(), runtime.new_site()) for _ in layers]
        static = [t.cuda() for t in inputs[0]]
        with torch.inference_mode():
            eager = _chain(runtime, layers, sites, *static, d)  # warms the kernels up, outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = _chain(runtime, layers, sites, *static, d)
            got = []
            for h, i, w in inputs:
                for s, v in zip(static, (h, i, w)):
                    s.copy_(v)
                graph.replay()
                got.append(out.clone())
            torch.cuda.synchronize()
        runtime.check_handoff()
        assert torch.equal(got[0], eager)  # the first replay's inputs are the eager call's
        tasks = [s.host_functions for site in runtime._sites.values() for s in site.staging.values()]
        assert tasks and all(isinstance(t, _GpuHandoffTask if handoff else _NativeHostFunctions) for t in tasks)
        results[handoff] = (eager, got)
        del graph
    assert torch.equal(results[True][0], results[False][0])
    for step, (a, b) in enumerate(zip(results[True][1], results[False][1])):
        assert torch.equal(a, b), f"replay {step}"
    for step in range(len(inputs)):  # the replays differ with their inputs (the graph did not replay stale data)
        assert step == 0 or not torch.equal(results[True][1][step], results[True][1][step - 1])


@needs_cuda
@pytest.mark.parametrize("deferred", [0, 1])
def test_generate_through_the_gpu_handoff_gives_the_eager_tokens(deferred):
    """ktorch.generate's captured step with the GPU handoff (the default) and with host functions gives the eager
    decode's tokens."""
    from ktorch.compile.experts_runtime import RUNTIME
    from ktorch.generation import generate
    from models import tiny_model

    torch.manual_seed(0)
    model = tiny_model("qwen3_moe", dtype=torch.float32)
    model.generation_config.eos_token_id = None
    ktorch.prepare(model, device="cuda", experts_dtype="bf16", gpu_memory="off")
    ktorch.set_deferred_experts(model, deferred)
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(10))
    eager = generate(model, ids, 48, cuda_graphs=False).ids
    before = RUNTIME.gpu_handoff
    try:
        for handoff in (True, False):
            RUNTIME.gpu_handoff = handoff
            model.kt_decoder = None
            assert generate(model, ids, 48).ids == eager, f"gpu_handoff={handoff}"
            tasks = [s.host_functions for site in RUNTIME._sites.values() for s in site.staging.values()
                     if s.host_functions is not None]
            assert any(isinstance(t, _GpuHandoffTask if handoff else _NativeHostFunctions) for t in tasks)
    finally:
        RUNTIME.gpu_handoff = before
    RUNTIME.check_handoff()


@needs_cuda
def test_a_failing_self_test_falls_back_to_host_functions(monkeypatch):
    """The runtime checks the kernels once per device before any capture (the doorbell must reach host memory,
    the waits must return clean): a doorbell that never lands (a ring doing nothing here) gives a warning and
    host functions for the captures, whose results are still right."""
    runtime = ExpertsRuntime()
    monkeypatch.setattr(gpu_handoff, "ring", lambda counter, seq, words: None)
    layers = _layers(runtime, 2)
    sites = [(runtime.new_site(), runtime.new_site()) for _ in layers]
    gen = torch.Generator().manual_seed(3)
    static = [torch.randn(1, 256, generator=gen).cuda(), torch.randint(0, 8, (1, 4), generator=gen).cuda(),
              torch.rand(1, 4, generator=gen).cuda()]
    with torch.inference_mode():
        with pytest.warns(RuntimeWarning, match="GPU handoff of CPU experts calls is unavailable"):
            eager = _chain(runtime, layers, sites, *static, 0)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _chain(runtime, layers, sites, *static, 0)
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(out, eager)
    tasks = [s.host_functions for site in runtime._sites.values() for s in site.staging.values()]
    assert tasks and all(isinstance(t, _NativeHostFunctions) for t in tasks)


@needs_cuda
def test_cudagraph_trees_keep_no_handoff_memory_in_their_pool(monkeypatch):
    """torch.compile(mode="reduce-overhead") (cudagraph trees) over a CPU experts call whose runtime has made nothing
    for the device yet: the warm-up run (eager, its allocations in the graph's pool) prepares the handoff and the
    recording makes the task, and neither leaves a tensor in the pool (the trees' own checks, on here, raise
    "tensor(s) in the cudagraph pool not tracked as outputs"). The replays give the eager op's results."""
    from torch._inductor import config as inductor_config

    from ktorch.compile.experts_runtime import RUNTIME

    monkeypatch.setattr(RUNTIME, "_handoff_seqs", {})  # as in a fresh process: the first CUDA call comes below
    monkeypatch.setattr(RUNTIME, "observers", [])
    monkeypatch.setattr(RUNTIME, "gpu_handoff", True)
    monkeypatch.setattr(inductor_config.triton, "slow_path_cudagraph_asserts", True)
    (layer,) = _layers(RUNTIME, 1)
    site = RUNTIME.new_site()

    def step(hidden, ids, weights):
        ticket = torch.ops.ktorch.submit_experts(hidden, ids, weights, layer, site)
        return torch.ops.ktorch.wait_experts(ticket, hidden, layer, site, []) * 2

    torch._dynamo.reset()
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    gen = torch.Generator().manual_seed(5)
    for i in range(4):  # warm-up, recording, replays
        args = (torch.randn(1, 256, generator=gen), torch.randint(0, 8, (1, 4), generator=gen),
                torch.rand(1, 4, generator=gen))
        torch.compiler.cudagraph_mark_step_begin()
        got = compiled(*(a.cuda() for a in args)).cpu()
        w = RUNTIME.layers[layer]
        want = torch.ops.kt.fused_moe(*args, w.w13, w.w13_scales, w.w2, w.w2_scales, "silu")
        assert torch.equal(got, want * 2), f"call {i}"
    tasks = [s.host_functions for s in RUNTIME._sites[site].staging.values()]
    assert tasks and all(isinstance(t, _GpuHandoffTask) for t in tasks)
    RUNTIME.check_handoff()


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_captured_prefill_call_moves_only_its_routed_rows(dtype):
    """A captured call of more than CAPTURED_STEP_ROWS rows (a captured prefill's, most of whose slots the split
    sends elsewhere: ids -1): only the rows of tokens with a routed slot cross to the pinned input (the others stay
    as the staging was made, zeros) and come back; every replay, with new values in the graph's inputs, gives the
    CPU op's result on the whole input bit for bit (unrouted rows zero)."""
    from ktorch.compile.experts_runtime import CAPTURED_STEP_ROWS

    runtime = ExpertsRuntime()
    (layer,) = _layers(runtime, 1)
    site = runtime.new_site()
    T, K = CAPTURED_STEP_ROWS + 45, 4
    gen = torch.Generator().manual_seed(11)

    def inputs():
        ids = torch.randint(0, 8, (T, K), generator=gen)
        ids[torch.rand(T, K, generator=gen) < 0.8] = -1
        ids[:40] = -1  # a block of tokens with nothing here
        return torch.randn(T, 256, generator=gen).to(dtype), ids, torch.rand(T, K, generator=gen)

    static = [t.cuda() for t in inputs()]
    w = runtime.layers[layer]

    def want(hidden, ids, weights):
        return torch.ops.kt.fused_moe(hidden, ids, weights, w.w13, w.w13_scales, w.w2, w.w2_scales, "silu")

    with torch.inference_mode():
        eager = runtime.wait(runtime.submit(*static, layer, site, join_now=True), static[0], layer, site)
        assert torch.equal(eager.cpu(), want(*(t.cpu() for t in static)))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = runtime.wait(runtime.submit(*static, layer, site, join_now=True), static[0], layer, site)
        (staging,) = runtime._sites[site].staging.values()
        for i in range(3):
            new = inputs()
            for s, n in zip(static, new):
                s.copy_(n)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out.cpu(), want(*new)), f"replay {i}"
            routed = (new[1] >= 0).any(1)
            assert torch.equal(staging.hidden[routed], new[0][routed])
        assert (staging.hidden[:40] == 0).all()  # never routed: never copied
    runtime.check_handoff()
