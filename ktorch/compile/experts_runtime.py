"""Submit/wait: the routed experts of a compiled graph run on the CPU while the device goes on with other work.

The async-boundary pass (ktorch/passes/async_boundary.py) replaces each ``kt.fused_moe`` call, with its hops
to the CPU and back, by two ops defined here:

    ticket = torch.ops.ktorch.submit_experts(hidden, topk_ids, topk_weights, layer, site)
    ...      work that does not need the result (e.g. DeepSeek's shared experts)
    out    = torch.ops.ktorch.wait_experts(ticket, hidden, layer, site, after)

``layer`` indexes the packed weights registered with ``ExpertsRuntime.register_layer`` at compile time, so the
graph carries no CPU tensors and Inductor's CUDA graphs accept it; ``site`` names the call site (one per
submit/wait pair). Calls at one site complete in order, so ``wait`` needs no value from ``submit``: the ticket
is an empty tensor that only orders the two ops. ``after`` lists tensors the wait must be ordered after (the
work moved between the two); its values are not read.

What submit and wait do depends on where the hidden states are:
  CPU (no GPU, CI): submit hands the op to the worker thread and returns; wait joins it.
  CUDA, eager:      submit copies hidden/ids/weights to pinned buffers (non-blocking), records an event and
                    hands the op to the worker, which waits for the event; wait blocks the host until the
                    worker is done and copies the result back (non-blocking). One host sync per layer.
  CUDA, capturing:  the same copies, and no host sync on the launching thread when the graph replays. The
                    C++ worker (runtime/host_tasks.cpp) is handed the call by the GPU itself (gpu_handoff.py):
                    a Triton kernel after the copies writes a sequence number into the task's pinned doorbell,
                    which the spinning worker watches; another before the result's H2D copy spins on the
                    pinned done word the worker writes when the output is complete (bounded: a call that never
                    finishes sets an error flag that ``check_handoff`` raises, never a silent stale result).
                    No host-function node for the CPU experts in the graph: CUDA runs one ~55 us after the
                    work before it has landed. The fallback, where Triton is missing, test observers watch the
                    calls or ``gpu_handoff`` is False (benchmarks' A/B): start/join host functions on the
                    stream (host_func.py), C ones (no GIL on CUDA's callback thread), or Python ones for test
                    observers (C ones decoded 1.58x faster on the device). The GPU handoff decodes faster
                    (48 layers, H200 host: 35.5 against 32.4 tok/s in host memory, 143.8 against 90.7 with
                    a 24 GiB budget; benchmarks/RESULTS.md section 2).

Expert deferral (passes/deferral.py) submits a layer once with ``submit_experts_split`` instead: the CPU side
ranks each token's slots by weight, runs the ``K - d`` highest (waited for at ``site``) and then the ``d`` lowest
(waited for at ``later_site``, one layer on). The stream pays what a plain layer costs: one set of input copies,
one start host function, no sorting or masking kernels.

The worker is one Python thread; ``kt.fused_moe`` releases the GIL and is parallel inside.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from ktorch.ops.deferred_slots import is_deferred_count, split_topk_slots

# ---------------------------------------------------------------- the worker

ASYNC_SLOTS = 4096  # call numbers of asynchronous eager waits in flight (a ring of pinned int64)
ASYNC_LIMIT_NS = 300_000_000_000  # an eager wait kernel's bound: 300 s (a very long prefill layer on the CPU)
CAPTURED_STEP_ROWS = 256  # a captured call of more rows (a captured prefill's) waits as long as an eager one
# a CUDA call of more rows moves only the rows of tokens routed to it, each way (_Staging.fill_routed): a prefill's,
# whose split leaves the CPU ~12% of the rows (skewed routing, T = 2048: 0.5 ms a layer of whole-tensor copies)
ROUTED_ROWS_MIN = 256


def _next_async_call(state: "_Site") -> int:
    if state.words is None:
        from ktorch.compile import gpu_handoff

        state.words = gpu_handoff.new_words()
    state.async_calls += 1
    return state.async_calls


def timed(fn: Callable[[], object], observe: Optional[Callable[[float], None]]):
    """fn(), and its seconds passed to ``observe`` when given and fn returned."""
    if observe is None:
        return fn()
    start = time.perf_counter()
    out = fn()
    observe(time.perf_counter() - start)
    return out


class _Task:
    __slots__ = ("fn", "done", "result", "error")

    def __init__(self, fn: Callable[[], object]):
        self.fn, self.done, self.result, self.error = fn, threading.Event(), None, None

    def join(self):
        self.done.wait()
        if self.error is not None:
            raise RuntimeError("ktorch: the CPU experts task failed") from self.error
        return self.result


class ExpertsWorker:
    """One daemon thread running submitted experts calls in submission order."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def enqueue(self, fn: Callable[[], object]) -> _Task:
        task = _Task(fn)
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="ktorch-experts", daemon=True)
                    self._thread.start()
        self._queue.put(task)
        return task

    def _run(self):
        torch.set_grad_enabled(False)  # per thread; the experts ops have no autograd
        while True:
            task = self._queue.get()
            try:
                task.result = task.fn()
            except BaseException as e:
                task.error = e
            finally:
                task.done.set()


# ---------------------------------------------------------------- per-layer weights and per-site state


@dataclass
class ExpertsLayer:
    w13: torch.Tensor
    w13_scales: Optional[torch.Tensor]
    w2: torch.Tensor
    w2_scales: Optional[torch.Tensor]
    activation: str
    w13_bias: Optional[torch.Tensor] = None  # the experts' biases (kt.fused_moe), or None
    w2_bias: Optional[torch.Tensor] = None

    runtime: Optional["ExpertsRuntime"] = None  # set by ExpertsRuntime.register_layer

    def run(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
            out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The op's result for this call: a new tensor, or written into ``out`` (kt.fused_moe_out: the eager
        calls' pinned staging, with no copy on the worker) and ``out`` returned."""
        runtime = self.runtime
        for observe in runtime.observers if runtime is not None else ():
            observe(self, hidden, topk_ids, topk_weights)
        start = time.perf_counter_ns()
        args = (hidden, topk_ids, topk_weights, self.w13, self.w13_scales, self.w2, self.w2_scales, self.activation,
                self.w13_bias, self.w2_bias)
        if out is None:
            out = torch.ops.kt.fused_moe(*args)
        else:
            torch.ops.kt.fused_moe_out(*args, out)
        if runtime is not None:
            end = time.perf_counter_ns()
            runtime.stats["experts_ns"] += end - start  # written by the worker thread only
            runtime.stats["experts_calls"] += 1
            if runtime.timeline is not None:
                runtime.timeline.append((start, end, hidden.shape[0]))
        return out


class _Staging:
    """Host buffers of one site for one call: inputs copied in, the result copied out. Pinned on a CUDA machine.

    A captured call's staging is its own (shape-keyed: a CUDA graph records its addresses, so it is never
    reallocated or shared); an eager call's is a slice of the site's grow-only ``_StagingPool``."""

    def __init__(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor,
                 deferred: Optional[torch.Tensor] = None, out_later: Optional[torch.Tensor] = None,
                 whole: Optional[dict] = None, aliases: Optional[dict] = None):
        self.hidden, self.topk_ids, self.topk_weights, self.out = hidden, topk_ids, topk_weights, out
        # ``alias_rows``: the whole buffers hidden and out are the first rows of (an eager call's pool; None: these
        # are), and their device aliases made so far (shared with the pool's other calls)
        self._whole = whole
        self._aliases = {} if aliases is None else aliases
        self.host_functions: Optional[tuple] = None  # (start, join[, join_later]), made on first capture
        # split stagings (submit_experts_split): the deferred slots' result, and d (one int64 read at each run:
        # RUNTIME's count for n_deferred="runtime", else the site's own)
        self.deferred = deferred
        self.out_later = out_later if deferred is not None else None
        self.split = (_SplitCall(self.hidden, self.topk_ids, self.topk_weights, deferred, self.out, self.out_later)
                      if deferred is not None else None)

    @classmethod
    def like(cls, hidden, topk_ids, topk_weights, deferred: Optional[torch.Tensor] = None) -> "_Staging":
        """New pinned buffers of exactly these shapes (a captured call's). The input's rows start zeroed: a
        compact fill (``fill_routed``) writes only the rows the call routes."""
        return cls(_host_like(hidden.shape, hidden.dtype).zero_(), _host_like(topk_ids.shape, topk_ids.dtype),
                   _host_like(topk_weights.shape, topk_weights.dtype), _host_like(hidden.shape, hidden.dtype),
                   deferred, _host_like(hidden.shape, hidden.dtype) if deferred is not None else None)

    def fill(self, hidden, topk_ids, topk_weights):
        self.hidden.copy_(hidden, non_blocking=True)
        self.topk_ids.copy_(topk_ids, non_blocking=True)
        self.topk_weights.copy_(topk_weights, non_blocking=True)

    def fill_routed(self, hidden, topk_ids, topk_weights) -> Optional[torch.Tensor]:
        """``fill`` where only the hidden rows of tokens with a slot routed here (an id >= 0) cross the bus, written
        by the device into the pinned input in place (``triton_gather.copy_routed_rows``); the op reads no other
        row. Returns a private copy of the ids on the device, for the wait to bring back the same rows (the
        caller's may be reused or changed before it: an Inductor graph plans its buffers without the wait), or
        None, with nothing done, where that cannot run (not CUDA, no Triton, a buffer the device cannot alias)."""
        if topk_ids.dim() != 2 or not topk_ids.is_contiguous() or topk_ids.shape[0] != hidden.shape[0]:
            return None
        moved = self.alias_rows("hidden", hidden)
        if moved is None:
            return None
        from ktorch.ops.triton_gather import copy_routed_rows

        self.topk_ids.copy_(topk_ids, non_blocking=True)
        self.topk_weights.copy_(topk_weights, non_blocking=True)
        copy_routed_rows(moved[0], moved[1], topk_ids, zero_others=False)
        return topk_ids.clone()

    def alias_rows(self, which: str, rows: torch.Tensor) -> Optional[tuple]:
        """(this staging's pinned ``which`` ("hidden" or "out") aliased on ``rows``' device, ``rows``) as [T, W]
        word tensors of one dtype, for ``copy_routed_rows`` either way; None where the device cannot read and write
        it in place, the kernel cannot run there, or ``rows`` is not a contiguous tensor of its shape and dtype
        (then the caller copies whole tensors). An alias is made once per buffer, word and device: its making asks
        the driver about the pointer, tens of microseconds on an eager prefill's launching thread."""
        from ktorch.ops.triton_gather import as_words, host_alias, kernel_runs_on, word_dtype

        host = getattr(self, which)
        if (not rows.is_cuda or not kernel_runs_on(rows) or rows.dim() != 2 or not rows.is_contiguous()
                or host.shape != rows.shape or host.dtype != rows.dtype):
            return None
        whole = host if self._whole is None else self._whole[which]
        dtype = word_dtype(host.element_size() * host.shape[1], whole.data_ptr(), rows.data_ptr())
        key = (which, dtype, rows.device)
        if key not in self._aliases:
            self._aliases[key] = host_alias(whole, dtype, rows.device)
        alias = self._aliases[key]
        if alias is None:
            return None
        return alias[:host.shape[0]], as_words(rows, dtype)

    def run_into_out(self, layer: ExpertsLayer) -> None:
        layer.run(self.hidden, self.topk_ids, self.topk_weights, out=self.out)


class _SplitCall:
    """The two parts of a split call (``submit_experts_split``), run in this order on the worker: ``now`` reads d
    from ``deferred`` (clamped to [0, K]), ranks each token's slots and runs the K - d highest-weighted; ``later``
    runs the d others, or gives zeros when d = 0. The Python side of what the native host tasks do in C++
    (runtime/host_tasks.cpp).

    On CPU hidden states (no staging) each part's result is a new tensor and the object lives for one call. A
    staging holds one for its pinned buffers and reuses it call after call: the parts write into ``out`` and
    ``out_later``, and the worker runs a call's ``later`` before the next call's ``now``."""

    def __init__(self, hidden, topk_ids, topk_weights, deferred: torch.Tensor,
                 out: Optional[torch.Tensor] = None, out_later: Optional[torch.Tensor] = None):
        self.hidden, self.topk_ids, self.topk_weights, self.deferred = hidden, topk_ids, topk_weights, deferred
        self.out, self.out_later = out, out_later
        self._ids_later: Optional[torch.Tensor] = None  # between the two parts; None when d = 0

    def now(self, layer: ExpertsLayer) -> torch.Tensor:
        k = self.topk_ids.shape[-1]
        d = min(max(int(self.deferred), 0), k)
        ids_now, self._ids_later = ((self.topk_ids, None) if d == 0
                                    else split_topk_slots(self.topk_ids, self.topk_weights, k - d))
        return _into(self.out, layer.run(self.hidden, ids_now, self.topk_weights))

    def later(self, layer: ExpertsLayer) -> torch.Tensor:
        ids, self._ids_later = self._ids_later, None
        if ids is None:
            if self.out_later is None:
                return torch.zeros_like(self.hidden, memory_format=torch.contiguous_format)
            return self.out_later.zero_()
        return _into(self.out_later, layer.run(self.hidden, ids, self.topk_weights))


def _into(buffer: Optional[torch.Tensor], result: torch.Tensor) -> torch.Tensor:
    return result if buffer is None else buffer.copy_(result)


def _host_like(shape, dtype) -> torch.Tensor:
    # Normal tensors even when the first call runs under torch.inference_mode: the worker thread, which writes the
    # result, is not in inference mode (the mode is per thread), and may not update inference tensors in place.
    # Pinned where CUDA is (what the stagings are for); plain memory on a CPU-only build (tests of the pool).
    with torch.inference_mode(False):
        return torch.empty(tuple(shape), dtype=dtype, pin_memory=torch.cuda.is_available())


class _StagingPool:
    """Grow-only host buffers of one site for eager calls of any token count: a call of T tokens gets the first T
    rows of each, so a new prompt length allocates nothing once the pool holds as many rows. Page-locking memory
    (cudaHostAlloc) costs about a millisecond per MB, and per-shape buffers made the first prefill of each prompt
    length 0.6-0.75 s slower than later ones (48 layers, 512 tokens, H100 host). Capacity grows to the next power
    of two of T (at least ``MIN_ROWS``). Eager calls only: a grown pool drops its old buffers, which no CUDA graph
    may hold (captured calls keep their own shape-keyed stagings)."""

    MIN_ROWS = 256

    def __init__(self, split: bool = False):
        self.rows = 0
        self.split = split  # holds out_later too (split calls: deferral)
        self.buffers: Optional[tuple] = None  # hidden, topk_ids, topk_weights, out, out_later (or None)
        self.allocations = 0  # times the buffers were (re)made, for tests
        self.busy = False  # the runtime's shared pool: a call between its submit and its wait holds it
        self._aliases: dict = {}  # the buffers' device aliases (_Staging.alias_rows), made again with them

    def staging(self, hidden, topk_ids, topk_weights, deferred: Optional[torch.Tensor] = None) -> _Staging:
        T = hidden.shape[0]
        if T > self.rows:
            rows = max(self.MIN_ROWS, 1 << (T - 1).bit_length())
            # the input's rows start zeroed: a call that moves only its routed rows (_Staging.fill_routed) leaves
            # the others as they are, and the op reads none of them
            self.buffers = (_host_like((rows, *hidden.shape[1:]), hidden.dtype).zero_(),
                            _host_like((rows, *topk_ids.shape[1:]), topk_ids.dtype),
                            _host_like((rows, *topk_weights.shape[1:]), topk_weights.dtype),
                            _host_like((rows, *hidden.shape[1:]), hidden.dtype),
                            _host_like((rows, *hidden.shape[1:]), hidden.dtype) if self.split else None)
            self.rows = rows
            self.allocations += 1
            self._aliases = {}  # a new dict: calls in flight keep the old buffers' (and the buffers) alive
        h, ids, w, out, later = (None if b is None else b[:T] for b in self.buffers)
        if deferred is not None and later is None:
            raise RuntimeError("experts runtime: a split call needs a split staging pool")
        return _Staging(h, ids, w, out, deferred, later, whole={"hidden": self.buffers[0], "out": self.buffers[3]},
                        aliases=self._aliases)


def _pool_key(hidden, topk_ids, topk_weights, split: bool) -> tuple:
    return (tuple(hidden.shape[1:]), hidden.dtype, tuple(topk_ids.shape[1:]), topk_ids.dtype, topk_weights.dtype, split)


class _Site:
    def __init__(self):
        self.pending: collections.deque = collections.deque()  # tasks submitted and not yet waited for
        self.staging: dict = {}  # shape key -> _Staging of a captured call
        self.pools: dict = {}  # (dtypes, row shapes, split) -> _StagingPool of eager calls
        self.held_pools: collections.deque = collections.deque()  # the shared pool (or None) per pending eager call
        # per pending eager CUDA call: the device ids whose routed rows alone crossed (_Staging.fill_routed), or None
        self.routed_pending: collections.deque = collections.deque()
        self.static_deferred: dict = {}  # d -> the int64 holding it, for split submits with a fixed d
        # asynchronous eager waits (ExpertsRuntime.async_waits): this site's calls are numbered 1, 2, ...; the
        # worker writes a call's number into words[1] (pinned) once its result is in its buffer, and the wait's GPU
        # kernel holds the stream until then. (call number, result buffer) per pending eager call.
        self.async_calls = 0
        self.words: Optional[torch.Tensor] = None
        self.async_pending: collections.deque = collections.deque()
        # (staging, capture number, which join host function: 1 = the call's, 2 = a split call's deferred part,
        # the buffer the result is copied from), one per captured submit this site's waits have not taken yet
        self.captured_pending: collections.deque = collections.deque()

    def pool_for(self, hidden, topk_ids, topk_weights, split: bool) -> _StagingPool:
        key = _pool_key(hidden, topk_ids, topk_weights, split)
        pool = self.pools.get(key)
        if pool is None:
            pool = self.pools[key] = _StagingPool(split)
        return pool

    def staging_for(self, hidden, topk_ids, topk_weights, deferred: Optional[torch.Tensor] = None,
                    captured: bool = False) -> _Staging:
        """A captured call's own buffers (made once per shape), or an eager call's rows of the site's pool."""
        if not captured:
            return self.pool_for(hidden, topk_ids, topk_weights, deferred is not None).staging(
                hidden, topk_ids, topk_weights, deferred)
        # a split staging reads d from its own tensor: one per d tensor (a site can be captured with another fixed
        # d after set_deferred_experts changes it)
        key = (tuple(hidden.shape), hidden.dtype, tuple(topk_ids.shape), topk_ids.dtype, topk_weights.dtype,
               None if deferred is None else id(deferred))
        if key not in self.staging:
            self.staging[key] = _Staging.like(hidden, topk_ids, topk_weights, deferred)
        return self.staging[key]


class ExpertsRuntime:
    """Packed weights by layer id, call sites, the worker, and the submit/wait implementations."""

    def __init__(self):
        self.layers: list[ExpertsLayer] = []
        self._layer_ids: dict = {}
        self._sites: dict[int, _Site] = collections.defaultdict(_Site)
        # Eager calls that are not split share one grow-only pool per shape class across all sites (layers): an eager
        # forward waits for each layer before the next layer submits, so one set of pinned buffers serves a whole
        # model, and a fresh process's first prefill page-locks one layer's rows, not every layer's. A call that
        # finds it held (another call in flight between its submit and wait) takes its site's own pool.
        self._shared_pools: dict = {}
        self._site_ids = itertools.count()
        self.worker = ExpertsWorker()
        # submits / host_waits / captured_submits / implied_joins, and experts_calls / experts_ns (kt.fused_moe time,
        # Python host functions and eager calls; the native host tasks' calls are in take_native_timeline), for tests
        # and benchmarks
        self.stats = collections.Counter()
        # Called on the worker thread as observe(layer, hidden, topk_ids, topk_weights) before each experts call
        # runs, in execution order, replays of CUDA graphs included (tests record routing with it).
        self.observers: list = []
        # When a list, each experts call appends (start_ns, end_ns, tokens) of its kt.fused_moe, perf_counter_ns
        # clock (profilers do not see the worker thread; benchmarks/bench_generate.py --profile-steps reads them per step).
        self.timeline: Optional[list] = None
        self._native_tasks: list = []  # _NativeHostFunctions made for captures (their timings are drained here)
        # Captured submits are numbered in stream order; _joined_through is the highest number whose join host
        # function a capture has launched. The native worker runs calls in that order, so a captured wait of an
        # earlier call needs no join of its own (deferral's waits, each behind the next layer's join).
        self._capture_numbers = itertools.count(1)
        self._joined_through: dict = {}  # by task kind (_NativeHostFunctions, _GpuHandoffTask)
        # n_deferred_experts="runtime": how many slots per token graphs compiled so defer, as an int and as the
        # int64 the split calls read when they run (CUDA-graph replays included)
        self.runtime_deferred = 0
        self._runtime_deferred_host = torch.zeros((), dtype=torch.int64)
        # GPU handoff (gpu_handoff.py) for captured calls, where available: doorbell + wait kernel instead of
        # host functions. False: host functions (benchmarks/bench_generate.py's A/B sets it; no user option).
        self.gpu_handoff = True  # read when a staging's task is made (at its first capture)
        # per CUDA device: its _HandoffSeqs (the doorbell counter and the tasks' sequence words), made outside any
        # capture when the kernels are warmed up (None: the kernels' self-test failed there, host functions)
        self._handoff_seqs: dict = {}
        self._handoff_error: Optional[torch.Tensor] = None  # int64 [1], pinned: a wait kernel that gave up
        # Asynchronous eager waits (``async_waits``, opened by Decoder.prefill on a GPU): the launching thread does
        # not wait for each layer's CPU experts; a GPU wait kernel holds the stream instead.
        self._async_depth = 0
        self._async_tasks: list = []  # the worker tasks of the open scope, joined when it closes
        self._async_seq: Optional[torch.Tensor] = None  # int64 [ASYNC_SLOTS], pinned: the waits' call numbers
        self._async_next = 0
        self._async_error: Optional[torch.Tensor] = None  # int64 [1], pinned: an eager wait kernel that gave up

    # -- compile time
    def register_layer(self, w13, w13_scales, w2, w2_scales, activation: str, w13_bias=None, w2_bias=None) -> int:
        """The id of these packed weights (the same tensors always get the same id)."""
        key = (id(w13), id(w2), w13.data_ptr(), w2.data_ptr(), activation, id(w13_bias), id(w2_bias))
        if key not in self._layer_ids:
            self._layer_ids[key] = len(self.layers)
            layer = ExpertsLayer(w13, w13_scales, w2, w2_scales, activation, w13_bias, w2_bias)
            layer.runtime = self
            self.layers.append(layer)
        return self._layer_ids[key]

    def new_site(self) -> int:
        return next(self._site_ids)

    def take_native_timeline(self) -> list:
        """(start_ns, end_ns, tokens) of the experts calls the native host tasks ran since the last call (the
        perf_counter_ns clock, like ``timeline``), for profiles of CUDA-graph replays."""
        out = []
        for task in self._native_tasks:
            times = torch.ops.kt.host_task_take_times(task.handle)
            out += [(times[i], times[i + 1], task.tokens) for i in range(0, len(times), 2)]
        return sorted(out)

    def set_runtime_deferred(self, n_deferred: int) -> None:
        if not is_deferred_count(n_deferred):
            raise ValueError(f"set_runtime_deferred_experts: n_deferred must be an int >= 0, got {n_deferred!r}")
        if n_deferred != int(self._runtime_deferred_host) and torch.cuda.is_initialized():
            # The split calls read the count when they run, on the CPU, as their start host function is reached: steps the host has already launched (replays queued behind the GPU) would otherwise run with
            # the new count, some of their layers deferring one d and some another (seen on the device: 95% of a
            # step's logits off under a loaded machine). They finish first, with the count they were launched under.
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("set_runtime_deferred_experts: cannot change the count inside a CUDA-graph capture")
            for device in range(torch.cuda.device_count()):
                torch.cuda.synchronize(device)
        self.runtime_deferred = n_deferred
        self._runtime_deferred_host.fill_(n_deferred)

    def reset(self) -> None:
        """Forgets every layer and site, freeing the packed weights it held; graphs compiled before stop working."""
        self.layers.clear()
        self._layer_ids.clear()
        self._sites.clear()
        self._shared_pools.clear()
        self._native_tasks.clear()
        self._joined_through.clear()

    def abandon_capture(self) -> None:
        """Forgets the captured submits no captured wait took (a capture that failed between the two): the next
        capture's waits must not take them."""
        for state in self._sites.values():
            state.captured_pending.clear()

    def check_handoff(self) -> None:
        """Raises if a GPU wait kernel of a captured step gave up on its CPU experts call (after
        gpu_handoff.LIMIT_NS, 2 s): the steps replayed since read a result that was not complete. Reads
        pinned memory: call it after synchronizing with the steps it covers (generate does, per token)."""
        error = self._handoff_error
        if error is not None and int(error[0]) != 0:
            raise RuntimeError(
                "ktorch: a CPU experts call of a captured step did not finish within the GPU's wait limit "
                f"(call number {int(error[0])}); the step's result was not used. The host-task worker is stuck or "
                "far slower than expected (see its messages above); restart the process")

    def _prepare_handoff(self, device: torch.device) -> None:
        """Outside any capture (an eager call): the device's doorbell counter and tasks' sequence words
        (``_HandoffSeqs``, topped up here once a capture used them all), the error flag, and one launch of each
        kernel (compiled and loaded here, not inside a capture)."""
        from ktorch.compile import gpu_handoff

        if device in self._handoff_seqs:
            seqs = self._handoff_seqs[device]
            if seqs is not None and seqs.free() == 0:
                seqs.grow()
            return
        if not self.gpu_handoff or not gpu_handoff.available():
            return
        with torch.inference_mode(False):
            if self._handoff_error is None:
                self._handoff_error = torch.zeros(1, dtype=torch.int64, pin_memory=True)
            words = gpu_handoff.new_words()
            scratch_error = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        try:
            seqs = _HandoffSeqs(device)
            counter, seq = seqs.counter, seqs.take()  # the self-test's number: a word no task gets
            with torch.cuda.device(device):
                gpu_handoff.ring(counter, seq, words)
                torch.cuda.current_stream(device).synchronize()
                rung = words.tolist()
                words[1:].fill_(1 << 62)  # done: the waits return at once (the worker never sees this doorbell)
                gpu_handoff.wait(seq, words, 1, scratch_error)
                gpu_handoff.wait(seq, words, 2, scratch_error)
                torch.cuda.current_stream(device).synchronize()
            if rung != [1, 0, 0] or int(scratch_error) != 0 or int(counter) != 1:
                raise RuntimeError(f"the kernels' self-test read doorbell words {rung}, error "
                                   f"{int(scratch_error)}, counter {int(counter)} (want [1, 0, 0], 0, 1)")
        except Exception as e:  # the host functions still work: slower, never wrong
            import warnings

            warnings.warn(f"ktorch: the GPU handoff of CPU experts calls is unavailable on {device} ({e}); captured "
                          f"steps use host functions", RuntimeWarning)
            self._handoff_seqs[device] = None  # not tried again
            return
        self._handoff_seqs[device] = seqs

    @contextlib.contextmanager
    def async_waits(self, device: torch.device):
        """While open, eager waits of CUDA calls do not block the launching thread: ``wait`` enqueues a GPU wait
        kernel (gpu_handoff.wait) on the call's done word and the result's copy behind it, so the host launches the
        next layer's attention while the CPU experts run. On closing, where the scope submitted CPU calls, the stream
        is synchronized and the scope's worker tasks joined: a failed CPU call or a wait kernel that gave up raises
        there, before any result of the scope is read (a scope that submitted none, every expert on the device,
        closes without a host sync). A no-op where the GPU handoff's kernels are unavailable."""
        device = torch.device(device)
        if device.type != "cuda":
            yield
            return
        self._prepare_handoff(device)
        if self._handoff_seqs.get(device) is None:  # the kernels' self-test failed here, or no Triton
            yield
            return
        if self._async_seq is None:
            with torch.inference_mode(False):
                self._async_seq = torch.zeros(ASYNC_SLOTS, dtype=torch.int64, pin_memory=True)
                self._async_error = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        self._async_depth += 1
        try:
            yield
        finally:
            self._async_depth -= 1
            if self._async_depth == 0:
                self._close_async(device)

    def _close_async(self, device: torch.device) -> None:
        tasks, self._async_tasks = self._async_tasks, []
        for state in self._sites.values():
            state.async_pending.clear()  # calls submitted and never waited for (a forward stopped halfway)
        if not tasks:  # no CPU call in the scope (every expert on the device): no wait kernel, nothing to check
            return
        torch.cuda.current_stream(device).synchronize()
        failed = None
        for task in tasks:
            try:
                task.join()
            except RuntimeError as e:
                failed = failed or e
        if failed is not None:
            raise failed
        error = int(self._async_error[0])
        if error != 0:
            self._async_error.zero_()
            raise RuntimeError(f"ktorch: an eager CPU experts call (number {error} at its site) did not finish within "
                               f"the GPU wait's limit ({ASYNC_LIMIT_NS / 1e9:.0f} s); its layer's result was not used")

    def _async_active(self, device: torch.device) -> bool:
        return self._async_depth > 0 and device.type == "cuda" and not self.observers

    # -- run time
    def submit(self, hidden, topk_ids, topk_weights, layer: int, site: int, join_now: bool = False,
               observe: Optional[Callable[[float], None]] = None) -> torch.Tensor:
        """``join_now``: the caller waits at ``site`` next, with no device work in between (eager callers): under
        capture the start and the join are then one host function, and that wait launches none. ``observe``
        (eager calls): called on the worker with the op's seconds once it has run (the prefill split's costs learn
        from them, RoutedExperts.cpu_observer)."""
        return self._submit(hidden, topk_ids, topk_weights, layer, site, join_now=join_now, observe=observe)

    def submit_split(self, hidden, topk_ids, topk_weights, layer: int, site: int, later_site: int,
                     n_deferred: int, join_now: bool = False) -> torch.Tensor:
        """One submit for a deferring layer: the K - d highest-weighted slots per token are waited for at ``site``,
        the d lowest at ``later_site`` (``n_deferred`` = d >= 0, or -1: the runtime count, read as the call runs)."""
        if n_deferred < -1:
            raise ValueError(f"submit_experts_split: n_deferred must be >= 0 or -1 (runtime), got {n_deferred}")
        if topk_ids.dim() != 2:
            raise ValueError(f"submit_experts_split: topk_ids must be [T, K], got {tuple(topk_ids.shape)}")
        if n_deferred < 0:
            deferred = self._runtime_deferred_host
        else:
            deferred = self._sites[site].static_deferred.get(n_deferred)
            if deferred is None:
                deferred = self._sites[site].static_deferred[n_deferred] = torch.tensor(n_deferred)
        return self._submit(hidden, topk_ids, topk_weights, layer, site, later_site, deferred, join_now=join_now)

    def _submit(self, hidden, topk_ids, topk_weights, layer: int, site: int, later_site: Optional[int] = None,
                deferred: Optional[torch.Tensor] = None, join_now: bool = False,
                observe: Optional[Callable[[float], None]] = None) -> torch.Tensor:
        weights, state = self.layers[layer], self._sites[site]
        later_state = self._sites[later_site] if later_site is not None else None
        ticket = torch.empty(0, dtype=torch.uint8, device=hidden.device)
        if hidden.device.type == "cpu":
            self.stats["submits"] += 1
            if later_state is None:
                state.pending.append(self.worker.enqueue(
                    lambda: timed(lambda: weights.run(hidden, topk_ids, topk_weights), observe)))
                return ticket
            split = _SplitCall(hidden, topk_ids, topk_weights, deferred)
            state.pending.append(self.worker.enqueue(lambda: split.now(weights)))
            later_state.pending.append(self.worker.enqueue(lambda: split.later(weights)))
            return ticket
        if hidden.device.type != "cuda":
            raise RuntimeError(f"ktorch.submit_experts: hidden states on {hidden.device} are not supported")
        capturing = torch.cuda.is_current_stream_capturing()
        if not capturing:
            self._prepare_handoff(hidden.device)
        if capturing:
            staging = state.staging_for(hidden, topk_ids, topk_weights, deferred, captured=True)
        else:
            shared = None
            if later_state is None:
                key = _pool_key(hidden, topk_ids, topk_weights, False)
                shared = self._shared_pools.get(key)
                if shared is None:
                    shared = self._shared_pools[key] = _StagingPool()
                if shared.busy:
                    shared = None
            if shared is not None:
                staging = shared.staging(hidden, topk_ids, topk_weights)
                shared.busy = True
            else:
                staging = state.staging_for(hidden, topk_ids, topk_weights, deferred)
            state.held_pools.append(shared)
            if later_state is not None:
                later_state.held_pools.append(None)  # one entry per pending call at that site too
        # a prefill's call (many rows, most of them routed elsewhere by the split): only its routed rows cross
        routed = None
        if later_state is None and hidden.shape[0] > ROUTED_ROWS_MIN:
            routed = staging.fill_routed(hidden, topk_ids, topk_weights)
        if routed is None:
            staging.fill(hidden, topk_ids, topk_weights)
        if not capturing:
            state.routed_pending.append(None if routed is None else (routed, staging))
            if later_state is not None:
                later_state.routed_pending.append(None)
        if capturing:
            self.stats["captured_submits"] += 1
            functions = self._host_functions(state, staging, weights, later_state, join_now, hidden.device, routed)
            if isinstance(functions, _GpuHandoffTask):
                functions.ring()
            elif not join_now:
                functions[0].launch()
            elif isinstance(functions, _NativeHostFunctions):
                functions[3].launch()  # start and join in one host function
            else:
                functions[0].launch()
                functions[1].launch()
            return ticket
        self.stats["submits"] += 1
        copied = torch.cuda.Event()
        copied.record()
        signal = self._async_active(hidden.device)
        if signal:  # the call's number at each site it is waited at: the worker signals it once the result is in
            number = _next_async_call(state)
            state.async_pending.append((number, staging.out))
            if later_state is not None:
                later_number = _next_async_call(later_state)
                later_state.async_pending.append((later_number, staging.out_later))

        def run():
            copied.synchronize()
            try:
                if later_state is None:
                    timed(lambda: staging.run_into_out(weights), observe)
                else:
                    staging.split.now(weights)
            finally:  # a failed call signals too (the stream goes on; the scope's close raises its error)
                if signal:
                    state.words[1] = number
            return staging.out  # what the wait copies back

        def run_later():
            try:
                return staging.split.later(weights)
            finally:
                if signal:
                    later_state.words[1] = later_number

        state.pending.append(self.worker.enqueue(run))
        if signal:
            self._async_tasks.append(state.pending[-1])
        if later_state is not None:
            later_state.pending.append(self.worker.enqueue(run_later))
            if signal:
                self._async_tasks.append(later_state.pending[-1])
        return ticket

    def wait(self, ticket, hidden, layer: int, site: int) -> torch.Tensor:
        state = self._sites[site]
        if hidden.device.type == "cpu":
            return state.pending.popleft().join()
        out = torch.empty_like(hidden, memory_format=torch.contiguous_format)
        if torch.cuda.is_current_stream_capturing():
            # the staging this capture's submit at this site used, that submit's number, its join and result
            staging, number, join, result, routed_ids = state.captured_pending.popleft()
            routed = None if routed_ids is None else (routed_ids, staging)
            handoff = isinstance(staging.host_functions, _GpuHandoffTask)
            if join == 0 and not handoff:  # joined by the submit's own host function (join_now)
                self.stats["implied_joins"] += 1
            elif self.join_implied(staging, number):
                self.stats["implied_joins"] += 1
            else:
                if handoff:  # a captured prefill's call (ktorch.generation) may take as long as an eager one
                    staging.host_functions.wait(2 if join == 2 else 1,
                                                ASYNC_LIMIT_NS if hidden.shape[0] > CAPTURED_STEP_ROWS else None)
                else:
                    staging.host_functions[join].launch()
                kind = type(staging.host_functions)
                self._joined_through[kind] = max(self._joined_through.get(kind, 0), number)
        elif state.async_pending and self._async_active(hidden.device):
            routed = state.routed_pending.popleft()
            # the stream waits for the call, not this thread: the worker's later calls start after their own input
            # copies, which the stream makes after this wait and the result's copy below, so a shared staging can be
            # handed on at once
            self.stats["async_waits"] += 1
            number, result = state.async_pending.popleft()
            state.pending.popleft()
            shared = state.held_pools.popleft()
            if shared is not None:
                shared.busy = False
            slot = self._async_next
            self._async_next = (slot + 1) % ASYNC_SLOTS
            self._async_seq[slot] = number  # read by the kernel below (ASYNC_SLOTS waits later at the earliest
            # is the slot written again: the scope's per-layer host syncs keep the host far closer to the stream)
            from ktorch.compile import gpu_handoff

            gpu_handoff.wait(self._async_seq[slot:slot + 1], state.words, 1, self._async_error, ASYNC_LIMIT_NS)
        else:
            self.stats["host_waits"] += 1
            routed = state.routed_pending.popleft()
            try:
                result = state.pending.popleft().join()
            finally:
                shared = state.held_pools.popleft()
                if shared is not None:
                    shared.busy = False  # the copy of the result queued below precedes any later fill on the stream
        if routed is not None:  # only the routed rows come back (the op wrote the others as zeros)
            moved = routed[1].alias_rows("out", out) if result is routed[1].out else None
            if moved is not None:
                from ktorch.ops.triton_gather import copy_routed_rows

                copy_routed_rows(moved[1], moved[0], routed[0], zero_others=True)
                return out
        out.copy_(result, non_blocking=True)
        return out

    def _host_functions(self, state: _Site, staging: _Staging, weights: ExpertsLayer,
                        later_state: Optional[_Site] = None, join_now: bool = False, device=None,
                        routed_ids: Optional[torch.Tensor] = None):
        """The staging's start/join host functions: C ones (runtime/host_tasks.cpp, no GIL on CUDA's callback
        thread), or Python ones where test observers (``observers``) must see each call. The C ones decode 1.58x
        faster (H100 host, 12 Qwen3-30B-A3B layers, int8: 137.6 against 87.3 tok/s; benchmarks/RESULTS.md)."""
        from ktorch.compile.host_func import HostFunction

        # made by an eager call before (a capture's warm-up step); None: host functions
        seqs = self._handoff_seqs.get(device) if self.gpu_handoff and not self.observers else None
        task = staging.host_functions
        if task is not None and (seqs is not None) != isinstance(task, _GpuHandoffTask):
            if isinstance(task, _GpuHandoffTask) or seqs.free():
                staging.host_functions = None  # captured before under the other handoff (an A/B): a new task
        if staging.host_functions is None and not self.observers:
            # Nothing is allocated on the device here: this runs inside captures, where the caching allocator puts
            # new tensors in the graph's private pool (cudagraph trees then refuse the graph: memory no output
            # tracks). The task's sequence word is one of those _prepare_handoff made; when a capture has used
            # them all, the task takes host functions (the next eager call makes more for later captures).
            seq = seqs.take() if seqs is not None else None
            if seq is not None:
                staging.host_functions = _GpuHandoffTask(staging, weights, seqs.counter, seq, self._handoff_error)
            else:
                if seqs is not None:
                    self.stats["handoff_words_short"] += 1
                staging.host_functions = _NativeHostFunctions(staging, weights)
            self._native_tasks.append(staging.host_functions)
        if staging.host_functions is None:
            split = staging.deferred is not None
            running: collections.deque = collections.deque()
            running_later: collections.deque = collections.deque()

            def start():  # on the driver thread, once the inputs are in pinned memory
                if not split:
                    running.append(self.worker.enqueue(lambda: staging.run_into_out(weights)))
                    return
                running.append(self.worker.enqueue(lambda: staging.split.now(weights)))
                running_later.append(self.worker.enqueue(lambda: staging.split.later(weights)))

            def join():  # holds the stream until the CPU result is in pinned memory
                running.popleft().join()

            def join_later():  # a split call's second part
                running_later.popleft().join()

            staging.host_functions = (HostFunction(start), HostFunction(join), HostFunction(join_later))
        number = next(self._capture_numbers)
        handoff = isinstance(staging.host_functions, _GpuHandoffTask)  # no host function: every wait launches one
        if join_now and isinstance(staging.host_functions, _NativeHostFunctions):
            self._joined_through[_NativeHostFunctions] = max(self._joined_through.get(_NativeHostFunctions, 0), number)
        # routed_ids: the call's device ids where only its routed rows crossed (``_Staging.fill_routed``): the wait
        # brings back only those rows of the result
        state.captured_pending.append((staging, number, 0 if join_now and not handoff else 1, staging.out,
                                       routed_ids))
        if later_state is not None:
            later_state.captured_pending.append((staging, number, 2, staging.out_later, None))
        return staging.host_functions

    def join_implied(self, staging: _Staging, number: int) -> bool:
        """Whether a captured wait for the submit numbered ``number`` can go without its join host function: the
        capture has already joined a later submit, and native host tasks run one at a time in submission order
        (one C++ worker, both parts of a split call before the next call), so the stream is past the end of this
        call too. Python host functions keep every join (their join pops the call it waits for). Deferral's waits
        are such: layer i's deferred part is waited for after layer i+1's join, so each would otherwise cost the
        stream one more host function round trip (~50 us on the H100 host), or one more wait kernel. The same holds
        for GPU-handoff tasks (one worker, doorbells taken lowest number first), within one kind of task: a pushed
        task and a rung doorbell are not ordered against each other."""
        kind = type(staging.host_functions)
        return kind in (_NativeHostFunctions, _GpuHandoffTask) and number < self._joined_through.get(kind, 0)


class _NativeTask:
    """A staging's native host task (runtime/host_tasks.cpp), made by ``host_task_new`` over the staging's tensors
    and the layer's weights (``words``: the GPU handoff's pinned doorbell and done words, or None); freed with the
    object."""

    def _new_task(self, staging: "_Staging", layer: ExpertsLayer, words=None) -> None:
        self.staging, self.layer = staging, layer  # the task holds these tensors; keep them referenced too
        self.tokens = staging.hidden.shape[0]
        # a split staging (deferral): the task also runs the deferred slots into out_later, d read from deferred
        deferred = getattr(staging, "deferred", None)
        extra = () if words is None else (words,)
        self.handle = torch.ops.kt.host_task_new(staging.hidden, staging.topk_ids, staging.topk_weights, staging.out,
                                                 layer.w13, layer.w13_scales, layer.w2, layer.w2_scales,
                                                 layer.activation, True,
                                                 staging.out_later if deferred is not None else None, deferred,
                                                 layer.w13_bias, layer.w2_bias, *extra)

    def error(self) -> str:
        return torch.ops.kt.host_task_error(self.handle)

    def __del__(self):
        handle, self.handle = getattr(self, "handle", 0), 0
        if handle:
            torch.ops.kt.host_task_free(handle)


class _NativeHostFunctions(_NativeTask):
    """The start/join host functions of one staging as C functions (runtime/host_tasks.cpp): indexable like the
    Python ones, ``[0].launch()`` starts, ``[1].launch()`` joins, ``[2].launch()`` joins a split call's deferred
    part, ``[3].launch()`` starts and joins the first part in one host function."""

    class _Fn:
        def __init__(self, ptr: int, handle: int):
            self.ptr, self.handle = ptr, handle

        def launch(self) -> None:
            from ktorch.compile.host_func import launch_native

            launch_native(self.ptr, self.handle)

    def __init__(self, staging: "_Staging", layer: ExpertsLayer):
        self._new_task(staging, layer)
        self._fns = tuple(self._Fn(fn, self.handle) for fn in torch.ops.kt.host_task_functions())

    def __getitem__(self, i: int):
        return self._fns[i]

    def run(self) -> None:
        """Start and join (both parts of a split call) on this thread, as the host functions do, for tests without
        CUDA."""
        torch.ops.kt.host_task_run(self.handle)


def _outside_graph_pools(make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``make()`` run on a new thread. The caching allocator sends a thread's CUDA allocations to a CUDA graph's
    private pool while that thread captures, and while cudagraph trees (torch.compile's "reduce-overhead") warm a
    graph up on it (the compiled function runs eagerly once, not capturing, its tensors in the pool: torch 2.8 and
    later route the warm-up by thread, older versions by its stream). Memory that outlives every graph is made on another
    thread: the device's ordinary pool (a tensor left in a graph's pool is memory that no graph output tracks,
    which cudagraph trees refuse, and may hand to a later graph)."""
    made: list = []

    def run():
        try:
            made.append(make())
        except BaseException as e:  # noqa: BLE001 - raised again on the caller's thread
            made.append(e)

    thread = threading.Thread(target=run, name="ktorch-handoff-alloc")
    thread.start()
    thread.join()
    if isinstance(made[0], BaseException):
        raise made[0]
    return made[0]


class _HandoffSeqs:
    """One device's GPU-handoff words in device memory: the doorbell counter (one int64 a device, so numbers grow in
    stream order across its tasks) and each task's sequence word, ``SLOTS`` int64 a block, made outside any capture
    and outside any graph's pool (``_outside_graph_pools``). Tasks are made inside captures, where a new device
    tensor would land in the graph's private pool; each takes a word of a block made before (``take``), and a
    capture that finds none left gives its task host functions (``grow``, at the next eager call, adds a block).
    Blocks are never freed: the graphs that captured their words may replay as long as the process runs."""

    SLOTS = 4096  # 32 KB a block; a 48-layer model's decode and prefill captures take a few hundred words

    def __init__(self, device: torch.device, slots: int = SLOTS):
        if slots < 2:
            raise ValueError(f"_HandoffSeqs: a block needs at least 2 words (the counter and a task's), got {slots}")
        self.device, self.slots = torch.device(device), slots
        self.blocks: list = []
        self._next = 0  # the next free word of the last block
        self.grow()
        self.counter = self.blocks[0][:1]
        self._next = 1

    def _block(self) -> torch.Tensor:
        def make():  # no kernel on the other thread: its zero fill runs on the caller's stream, before any ring
            return torch.empty(self.slots, dtype=torch.int64, device=self.device)

        with torch.inference_mode(False):  # a plain tensor whatever the caller's mode (the new thread has none)
            block = _outside_graph_pools(make) if self.device.type == "cuda" else make()
            return block.zero_()

    def grow(self) -> None:
        """Another block of words (outside any capture)."""
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("_HandoffSeqs.grow: not inside a CUDA-graph capture")
        self.blocks.append(self._block())
        self._next = 0

    def free(self) -> int:
        """Words left for tasks."""
        return self.slots - self._next

    def take(self) -> Optional[torch.Tensor]:
        """A task's sequence word: an int64 [1] view of a block (no allocation), or None when none is left."""
        if self._next >= self.slots:
            return None
        word = self.blocks[-1][self._next:self._next + 1]
        self._next += 1
        return word


class _GpuHandoffTask(_NativeTask):
    """A staging's native host task handed over by the GPU (gpu_handoff.py): ``ring()`` after the input copies
    (the doorbell kernel: the device's next number into the task's pinned doorbell, which the C++ worker watches),
    ``wait(part)`` before the result's copy (the wait kernel: until the worker's done word for part 1, the call, or
    2, a split call's deferred part, reaches that number). No host function: the graph holds two small kernels."""

    def __init__(self, staging: "_Staging", layer: ExpertsLayer, counter: torch.Tensor, seq: torch.Tensor,
                 error: torch.Tensor):
        """``counter``: the device's doorbell counter; ``seq``: the task's own int64 [1] word, device memory written
        by each ring before any wait reads it (a slot of ``_HandoffSeqs``: the task is made inside captures and
        allocates no device memory); ``error``: the pinned error flag."""
        from ktorch.compile import gpu_handoff

        if seq.shape != (1,) or seq.dtype != torch.int64 or seq.device != counter.device:
            raise ValueError(f"_GpuHandoffTask: seq must be an int64 [1] tensor on {counter.device}, got {seq.dtype} "
                             f"{tuple(seq.shape)} on {seq.device}")
        self.counter, self.seq, self.error_flag = counter, seq, error
        self.words = gpu_handoff.new_words()  # doorbell, done, done_later (pinned host memory)
        self._new_task(staging, layer, self.words)

    def ring(self) -> None:
        from ktorch.compile import gpu_handoff

        gpu_handoff.ring(self.counter, self.seq, self.words)

    def wait(self, part: int, limit_ns: Optional[int] = None) -> None:
        from ktorch.compile import gpu_handoff

        gpu_handoff.wait(self.seq, self.words, part, self.error_flag, limit_ns or gpu_handoff.LIMIT_NS)


RUNTIME = ExpertsRuntime()


# ---------------------------------------------------------------- the ops the graph calls


@torch.library.custom_op("ktorch::submit_experts", mutates_args=())
def submit_experts(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, layer: int,
                   site: int) -> torch.Tensor:
    """Starts layer ``layer``'s routed experts on the CPU for hidden [T, H], topk_ids/topk_weights [T, K].

    Returns an empty ticket on hidden's device; pass it to ``wait_experts`` with the same site."""
    return RUNTIME.submit(hidden, topk_ids, topk_weights, layer, site)


@submit_experts.register_fake
def _submit_experts_fake(hidden, topk_ids, topk_weights, layer, site):
    return hidden.new_empty((0,), dtype=torch.uint8)


@torch.library.custom_op("ktorch::submit_experts_split", mutates_args=())
def submit_experts_split(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, layer: int,
                         site: int, later_site: int, n_deferred: int) -> torch.Tensor:
    """``submit_experts`` for a deferring layer: per token, the ``K - n_deferred`` highest-weighted slots (ties to
    the lower slot) are waited for at ``site``, the others at ``later_site`` (``wait_experts`` with the same ticket;
    zeros when none is deferred). ``n_deferred = -1``: the count ``set_runtime_deferred_experts`` set, read when
    the call runs (CUDA-graph replays included). The CPU side splits the slots: the device does no extra work."""
    return RUNTIME.submit_split(hidden, topk_ids, topk_weights, layer, site, later_site, n_deferred)


@submit_experts_split.register_fake
def _submit_experts_split_fake(hidden, topk_ids, topk_weights, layer, site, later_site, n_deferred):
    return hidden.new_empty((0,), dtype=torch.uint8)


def set_runtime_deferred_experts(n_deferred: int) -> None:
    """Sets how many of each token's routed experts (the lowest-weighted) the graphs compiled with
    ``options={"n_deferred_experts": "runtime"}`` defer, from their next run on, CUDA-graph replays included: one
    compile serves every d (benchmarks sweep d without compiling again). Process-wide; d >= K defers all slots but
    the last layer's; 0 defers nothing (the deferred parts then return zeros without running). A change first waits
    for the work already launched on the GPUs (a device synchronize), which runs with the count it was launched
    under; not allowed inside a CUDA-graph capture."""
    RUNTIME.set_runtime_deferred(n_deferred)


@torch.library.custom_op("ktorch::wait_experts", mutates_args=())
def wait_experts(ticket: torch.Tensor, hidden: torch.Tensor, layer: int, site: int,
                 after: Sequence[torch.Tensor]) -> torch.Tensor:
    """The result [T, H] (hidden's dtype and device) of the ``submit_experts`` call at ``site``.

    ``hidden`` is that call's input (it gives the result's shape); ``after`` only orders this op after them."""
    return RUNTIME.wait(ticket, hidden, layer, site)


@wait_experts.register_fake
def _wait_experts_fake(ticket, hidden, layer, site, after):
    return torch.empty_like(hidden, memory_format=torch.contiguous_format)
