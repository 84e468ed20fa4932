"""Native host tasks (runtime/host_tasks.cpp): the C start/join functions that CUDA host functions call under
CUDA graphs. Here they are called directly (as CUDA's callback thread would), on
the CPU, against kt.fused_moe."""

from __future__ import annotations

import ctypes
import threading
import time
import types

import pytest
import torch

import ktorch
from ktorch.compile.experts_runtime import ExpertsLayer, ExpertsRuntime, _NativeHostFunctions

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


@pytest.mark.parametrize("d", [None, 2])
def test_start_join_is_start_then_join_in_one_function(d):
    """The fused host function (runtime.submit(join_now=True) under capture): on return the first part is complete;
    a split task's deferred part completes behind it (join_later)."""
    if d is None:
        staging, layer, packed = make_task(3, T=17)
        task = _NativeHostFunctions(staging, layer)
    else:
        staging, task, packed = split_task(4, d)
    start_join, join_later = _FN(task[3].ptr), _FN(task[2].ptr)
    for _ in range(4):
        staging.hidden.copy_(torch.randn_like(staging.hidden))
        staging.out.fill_(7.0)
        t = threading.Thread(target=start_join, args=(task.handle,))
        t.start()
        t.join(timeout=30)
        assert not t.is_alive()
        if d is None:
            assert torch.equal(staging.out, expected(staging, packed))
        else:
            now, later = expected_split(staging, packed, d)
            assert torch.equal(staging.out, now)
            join_later(task.handle)
            assert torch.equal(staging.out_later, later)
    assert task.error() == ""


def split_task(seed: int, d: int, T: int = 9, K: int = 4, ids_dtype=torch.int64, weights_dtype=torch.float32):
    """A split (deferral) host task: K slots per token, d read from its own int64 at each run."""
    staging, layer, packed = make_task(seed, T=T)
    staging.topk_ids = torch.randint(-1, 6, (T, K), dtype=ids_dtype)
    staging.topk_weights = torch.randint(0, 4, (T, K)).to(weights_dtype) / 4  # many ties
    staging.deferred = torch.tensor(d)
    staging.out_later = torch.full((T, staging.hidden.shape[1]), 5.0)
    return staging, _NativeHostFunctions(staging, layer), packed


def expected_split(staging, packed, d):
    from ktorch.passes.deferral import split_topk_slots

    K = staging.topk_ids.shape[1]
    now, later = split_topk_slots(staging.topk_ids, staging.topk_weights, K - min(d, K))
    run = lambda ids: torch.ops.kt.fused_moe(staging.hidden, ids, staging.topk_weights, *packed.tensors(), "silu")
    return run(now), (run(later) if min(d, K) > 0 else torch.zeros_like(staging.hidden))


@pytest.mark.parametrize("ids_dtype,weights_dtype", [(torch.int64, torch.float32), (torch.int32, torch.bfloat16)])
def test_split_task_runs_the_highest_weighted_slots_then_the_rest(ids_dtype, weights_dtype):
    """The C++ split ranks slots as split_topk_slots does (stable, descending; ties to the lower slot), reads d at
    each run (0, more than K, any in between), runs both parts, and leaves zeros in out_later when d = 0."""
    staging, task, packed = split_task(21, 2, ids_dtype=ids_dtype, weights_dtype=weights_dtype)
    assert len(task._fns) == 4  # start, join, join_later, start_join
    for d in (2, 0, 1, 4, 3, 9, 0):
        staging.deferred.fill_(d)
        staging.hidden.copy_(torch.randn_like(staging.hidden))
        staging.topk_ids.copy_(torch.randint(-1, 6, staging.topk_ids.shape))
        task.run()
        now, later = expected_split(staging, packed, d)
        assert torch.equal(staging.out, now), f"d={d}"
        assert torch.equal(staging.out_later, later), f"d={d}"
    assert task.error() == ""


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("T,K,dtype", [(1, 8, torch.float32), (5, 3, torch.bfloat16), (77, 6, torch.float16),
                                       (600, 4, torch.float32)])
@pytest.mark.parametrize("threads", [1, 3])
def test_split_task_one_call_gives_each_part_as_its_own_call(fmt, T, K, dtype, threads):
    """A split task runs both parts in one kt::moe::fused_moe_split call (one pool dispatch, the first part
    published from inside it): each output is bit for bit what a fused_moe call with that part's ids gives, for
    every format, hidden dtype, decode to prefill-sized T (chunks of several sizes, channels split or not) and a
    pool of one thread (every task on the caller, in order) or several."""
    before = ktorch.get_num_threads()
    try:
        ktorch.set_num_threads(threads)
        gen = torch.Generator().manual_seed(1000 * T + K)
        E, H, I = 9, 256, 192
        packed = ktorch.pack_experts(torch.randn(E, 2 * I, H, generator=gen) * 0.05,
                                     torch.randn(E, H, I, generator=gen) * 0.05, fmt)
        layer = ExpertsLayer(*packed.tensors(), "silu")
        staging = types.SimpleNamespace(
            hidden=torch.randn(T, H, generator=gen).to(dtype), topk_ids=torch.randint(-1, E, (T, K), generator=gen),
            topk_weights=torch.rand(T, K, generator=gen), out=torch.zeros(T, H, dtype=dtype),
            out_later=torch.full((T, H), 3.0, dtype=dtype), deferred=torch.tensor(K // 2))
        task = _NativeHostFunctions(staging, layer)
        for d in (K // 2, K - 1, 1):
            staging.deferred.fill_(d)
            task.run()
            now, later = expected_split(staging, packed, d)
            assert torch.equal(staging.out, now), f"d={d}"
            assert torch.equal(staging.out_later, later), f"d={d}"
        assert task.error() == ""
    finally:
        ktorch.set_num_threads(before)


def test_split_task_all_deferred_slots_skipped():
    """A deferred part that routes no pair (every deferred slot's id negative) gives zeros; the first part runs."""
    staging, task, packed = split_task(28, 2, K=4)
    staging.topk_weights.copy_(torch.tensor([0.4, 0.3, 0.2, 0.1]).expand_as(staging.topk_weights))
    staging.topk_ids[:, 2:] = -1  # the two lowest-weighted slots
    task.run()
    now, _ = expected_split(staging, packed, 2)
    assert torch.equal(staging.out, now)
    assert torch.equal(staging.out_later, torch.zeros_like(staging.out_later))


def test_split_task_rows_only_the_deferred_part_routes():
    """Rows whose first part routes nothing and rows routed nowhere (padding): the call converts the activations of
    the rows either part routes (fused_moe.cpp ``Shared::routed``), so the deferred part's rows are still computed:
    each part bit for bit its own call."""
    staging, task, packed = split_task(40, 2, T=37, K=4)
    staging.topk_weights.copy_(torch.tensor([0.4, 0.3, 0.2, 0.1]).expand_as(staging.topk_weights))
    staging.topk_ids[0::2, :2] = -1  # even rows: only the two deferred (lowest-weighted) slots route
    staging.topk_ids[30:] = -1  # padding
    task.run()
    now, later = expected_split(staging, packed, 2)
    assert torch.equal(staging.out, now) and torch.equal(staging.out_later, later)
    assert later[0::2][:15].abs().sum() > 0 and (now[0::2] == 0).all() and (later[30:] == 0).all()


def test_split_task_parts_sum_to_the_whole_call():
    staging, task, packed = split_task(22, 1, T=17, K=6)
    task.run()
    whole = torch.ops.kt.fused_moe(staging.hidden, staging.topk_ids, staging.topk_weights, *packed.tensors(), "silu")
    torch.testing.assert_close(staging.out + staging.out_later, whole, rtol=2e-2, atol=2e-2)


def test_split_task_first_join_returns_before_the_deferred_part_ends():
    """kt_host_task_join waits for the first part only: it returns while the deferred part still runs (checked
    against the task's own timeline: a deferred part of tens of milliseconds, so that a joining thread the
    scheduler delays on a small machine still returns before it ends), and kt_host_task_join_later waits for it."""
    staging, layer, packed = make_task(23, T=2048, E=8, H=512, I=512, fmt="bf16")
    staging.topk_ids = torch.randint(0, 8, (2048, 4))
    staging.topk_weights = torch.rand(2048, 4)
    staging.deferred = torch.tensor(3)
    staging.out_later = torch.zeros_like(staging.out)
    task = _NativeHostFunctions(staging, layer)
    start, join, join_later = (_FN(task[i].ptr) for i in range(3))
    early = 0
    for _ in range(3):
        start(task.handle)
        join(task.handle)
        joined = time.perf_counter_ns()
        join_later(task.handle)
        (now_start, now_end), (later_start, later_end) = zip(*[iter(torch.ops.kt.host_task_take_times(task.handle))] * 2)
        assert now_start <= now_end <= later_start <= later_end  # the parts run in order
        early += now_end <= joined < later_end
        now, later = expected_split(staging, packed, 3)
        assert torch.equal(staging.out, now) and torch.equal(staging.out_later, later)
    assert early > 0, "the first join never returned before the deferred part ended"


def test_split_task_failure_gives_nan_in_both_parts():
    staging, task, _ = split_task(25, 2)
    staging.topk_ids[0, :] = 99  # out of range for 6 experts, in both parts
    task.run()
    assert torch.isnan(staging.out).all() and torch.isnan(staging.out_later).all()
    assert "out of range for 6 experts" in task.error()


def test_split_task_timeline_has_one_interval_per_part_run():
    staging, task, _ = split_task(26, 1)
    runtime = ExpertsRuntime()
    runtime._native_tasks.append(task)
    task.run()
    staging.deferred.fill_(0)
    task.run()
    assert len(runtime.take_native_timeline()) == 3  # two parts, then one (d = 0 runs nothing second)


def test_split_task_arguments_are_checked():
    staging, layer, _ = make_task(27)
    w13, s13, w2, s2 = layer.w13, layer.w13_scales, layer.w2, layer.w2_scales
    args = (staging.hidden, staging.topk_ids, staging.topk_weights, staging.out, w13, s13, w2, s2, "silu", False)
    with pytest.raises(RuntimeError, match="needs both out_later and deferred"):
        torch.ops.kt.host_task_new(*args, torch.zeros_like(staging.out), None)
    with pytest.raises(RuntimeError, match="out_later must be a contiguous CPU tensor like out"):
        torch.ops.kt.host_task_new(*args, torch.zeros(3, 3), torch.tensor(1))
    with pytest.raises(RuntimeError, match="deferred must be one int64"):
        torch.ops.kt.host_task_new(*args, torch.zeros_like(staging.out), torch.tensor([1, 2]))
    with pytest.raises(RuntimeError, match="deferred must be one int64"):
        torch.ops.kt.host_task_new(*args, torch.zeros_like(staging.out), torch.tensor(1.0))
    bad = (staging.hidden, staging.topk_ids, staging.topk_weights[:, :2].contiguous()) + args[3:]
    with pytest.raises(RuntimeError, match="split task needs contiguous int32/int64 topk_ids"):
        torch.ops.kt.host_task_new(*bad, torch.zeros_like(staging.out), torch.tensor(1))


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


# ---------------------------------------------------------------- GPU handoff (made with handoff words)
# The GPU's part (gpu_handoff.py: a device counter's next number into the doorbell after the input copies, then a
# spin on the done word) is played here by a Python thread writing and polling the three pinned int64 words.

_NUMBERS = iter(range(1, 1 << 40))  # one counter, as the device's: numbers grow across tasks


def handoff_task(seed: int, split_d=None, **shape):
    staging, layer, packed = make_task(seed, **shape)
    if split_d is not None:
        K = 4
        T = staging.hidden.shape[0]
        staging.topk_ids = torch.randint(-1, 6, (T, K))
        staging.topk_weights = torch.rand(T, K)
        staging.deferred = torch.tensor(split_d)
        staging.out_later = torch.full_like(staging.out, 5.0)
    words = torch.zeros(3, dtype=torch.int64)
    handle = torch.ops.kt.host_task_new(staging.hidden, staging.topk_ids, staging.topk_weights, staging.out,
                                        layer.w13, layer.w13_scales, layer.w2, layer.w2_scales, "silu", True,
                                        getattr(staging, "out_later", None), getattr(staging, "deferred", None),
                                        None, None, words)
    return staging, packed, words, handle


def ring_and_wait(words, part: int = 1, timeout_s: float = 30.0) -> int:
    """The GPU's part: the next number into the doorbell, then a poll of words[part] until it reaches it."""
    seq = next(_NUMBERS)
    words[0] = seq
    deadline = time.monotonic() + timeout_s
    while int(words[part]) < seq:
        assert time.monotonic() < deadline, f"words[{part}] stayed {int(words[part])} below {seq}"
        time.sleep(0)
    return seq


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_handoff_task_runs_from_its_doorbell_and_publishes_its_number(fmt):
    """Each doorbell number starts one call; when the done word holds that number, out is the call's result (the
    worker writes it after the output), and the number never runs again (the done word stays put)."""
    staging, packed, words, handle = handoff_task(31, T=9, fmt=fmt)
    try:
        for step in range(5):
            staging.hidden.copy_(torch.randn_like(staging.hidden))
            staging.topk_ids.copy_(torch.randint(-1, 6, staging.topk_ids.shape))
            staging.out.fill_(3.0)
            seq = ring_and_wait(words)
            assert int(words[1]) == seq and int(words[2]) == 0  # a plain task: no deferred part
            assert torch.equal(staging.out, expected(staging, packed)), f"step {step}"
        assert len(torch.ops.kt.host_task_take_times(handle)) == 2 * 5  # one run per number
        assert torch.ops.kt.host_task_error(handle) == ""
    finally:
        torch.ops.kt.host_task_free(handle)


def test_handoff_split_task_publishes_each_part():
    """A split task's first part is in out when words[1] reaches the number, its deferred part in out_later when
    words[2] does; d is read at each run (0: zeros, no second call)."""
    staging, packed, words, handle = handoff_task(32, split_d=2, T=7)
    try:
        for d in (2, 0, 3, 1):
            staging.deferred.fill_(d)
            staging.hidden.copy_(torch.randn_like(staging.hidden))
            seq = ring_and_wait(words, 1)
            now, later = expected_split(staging, packed, d)
            assert torch.equal(staging.out, now), f"d={d}"
            deadline = time.monotonic() + 30
            while int(words[2]) < seq:
                assert time.monotonic() < deadline
            assert torch.equal(staging.out_later, later), f"d={d}"
        assert torch.ops.kt.host_task_error(handle) == ""
    finally:
        torch.ops.kt.host_task_free(handle)


def test_handoff_doorbells_run_lowest_number_first():
    """Doorbells rung while the worker is busy run in the order of their numbers (the order the GPU rang them), not
    the order they were written or made."""
    a_staging, a_packed, a_words, a = handoff_task(33, T=3)
    b_staging, b_packed, b_words, b = handoff_task(34, T=3)
    try:
        for tokens in (1024, 4096, 16384):  # a longer busy call if the worker finished before both were written
            busy, busy_layer, _ = make_task(35, T=tokens, E=8, H=512, I=512, fmt="bf16")
            c = _NativeHostFunctions(busy, busy_layer)  # a pushed task: keeps the worker busy
            threading.Thread(target=_FN(c[0].ptr), args=(c.handle,)).start()
            time.sleep(0.005)
            seq_a, seq_b = next(_NUMBERS), next(_NUMBERS)
            b_words[0] = seq_b  # the later number written first
            a_words[0] = seq_a
            written = time.perf_counter_ns()
            _FN(c[1].ptr)(c.handle)  # join c
            deadline = time.monotonic() + 60
            while int(a_words[1]) < seq_a or int(b_words[1]) < seq_b:
                assert time.monotonic() < deadline
            (c_start, c_end), (a_start, _), (b_start, _) = (torch.ops.kt.host_task_take_times(h)[-2:]
                                                            for h in (c.handle, a, b))
            if c_end > written:  # both were rung before the worker was free
                assert a_start < b_start
                break
        else:
            pytest.fail("the busy call never outlasted writing two doorbells")
        assert torch.equal(a_staging.out, expected(a_staging, a_packed))
        assert torch.equal(b_staging.out, expected(b_staging, b_packed))
    finally:
        torch.ops.kt.host_task_free(a)
        torch.ops.kt.host_task_free(b)


def test_handoff_reaches_a_parked_worker():
    """Nothing wakes the worker when the GPU writes a doorbell: a parked worker looks at the doorbells on its own
    (every 100 us, every 1 ms once idle for 100 ms), so a call rung after a long pause still runs."""
    staging, packed, words, handle = handoff_task(36, T=4)
    try:
        time.sleep(0.3)  # past the worker's spin (2 ms) and the idle threshold (100 ms)
        t0 = time.monotonic()
        ring_and_wait(words, timeout_s=10)
        assert time.monotonic() - t0 < 5
        assert torch.equal(staging.out, expected(staging, packed))
    finally:
        torch.ops.kt.host_task_free(handle)


def test_handoff_failure_gives_nan_and_still_publishes():
    """A failing call publishes its number too (the GPU must not wait for a call that ended), with NaN in out and
    the message kept."""
    staging, _, words, handle = handoff_task(37, T=5)
    try:
        staging.topk_ids[0, 0] = 99  # out of range for 6 experts
        ring_and_wait(words)
        assert torch.isnan(staging.out).all()
        assert "out of range for 6 experts" in torch.ops.kt.host_task_error(handle)
    finally:
        torch.ops.kt.host_task_free(handle)


def test_handoff_task_refuses_a_host_function_start():
    """A handoff task runs from its doorbell only: the start host function records a clear error and runs
    nothing (a doorbell plus a start would run one call twice)."""
    staging, _, words, handle = handoff_task(38, T=3)
    try:
        staging.out.fill_(2.0)
        torch.ops.kt.host_task_run(handle)  # start + join, as the host functions would
        assert torch.equal(staging.out, torch.full_like(staging.out, 2.0))
        assert "started by its doorbell, not by a host function" in torch.ops.kt.host_task_error(handle)
        assert int(words[1]) == 0
    finally:
        torch.ops.kt.host_task_free(handle)


def test_handoff_words_are_checked():
    staging, layer, _ = make_task(39)
    w13, s13, w2, s2 = layer.w13, layer.w13_scales, layer.w2, layer.w2_scales
    args = (staging.hidden, staging.topk_ids, staging.topk_weights, staging.out, w13, s13, w2, s2, "silu", False,
            None, None, None, None)
    for bad in (torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int32), torch.zeros(3, 1, dtype=torch.int64),
                torch.zeros(6, dtype=torch.int64)[::2]):
        with pytest.raises(RuntimeError, match=r"handoff must be three int64 \(doorbell, done, done_later\)"):
            torch.ops.kt.host_task_new(*args, bad)
    with pytest.raises(RuntimeError, match="a new handoff must read 0 0 0, got 0 4 0"):
        torch.ops.kt.host_task_new(*args, torch.tensor([0, 4, 0]))
    out_as_words = staging.out.view(-1).view(torch.int64)[:3]  # the words inside the output buffer
    out_as_words.zero_()
    with pytest.raises(RuntimeError, match="handoff overlaps the task's staging tensors"):
        torch.ops.kt.host_task_new(*args, out_as_words)
