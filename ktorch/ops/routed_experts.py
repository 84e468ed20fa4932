"""Routing-aware prefill: per MoE layer and call, each expert the batch uses runs where it costs least.

Once a layer's router has run, the experts a long batch uses are known, and so is each one's row count (tokens
routed to it). Every used expert then goes to one of three places:

  resident    it is held on the accelerator (``ktorch.gpu_memory``'s budget): computed there, nothing copied;
  copied      its packed bytes are copied host-to-device (page-locked, asynchronous DMA), dequantized there and
              computed with ``gpu_experts_forward``, while the CPU op works;
  CPU         the CPU op computes it (its slots stay in the ids the op gets; the others are masked to -1).

Experts the batch does not use move nowhere. The choice balances the two processors with measured costs
(``SplitCosts``, from ``calibrate_split_costs``):

    CPU time     = fixed + row_s * rows on the CPU + expert_s * experts on the CPU      (expert_s: reading one
                                                                                         expert's weights, cold)
    device time  = copied experts * (bytes / H2D bandwidth + dequantization) + device_row_s * rows on the device

The CPU law is then refitted to the split's own eager calls as they run (``SplitCosts.refit_cpu``,
docs/prefill_streaming.md); a captured prefill's choice keeps the calibration's (``SplitCosts.calibrated``).
Copied experts are taken most-hit first (the most rows per byte copied); ``choose_device_experts`` picks the
count that minimises max(CPU time, device time). A near-uniform 512-token batch on a 128-expert layer hits every
expert about as often, so roughly a share of them is copied, as before; a skewed one (routing that concentrates)
hits few experts, most rows land on the most-hit ones, and those few are what moves. They are gathered
(``gather_experts``: on CUDA one zero-copy Triton launch a layer, the SMs reading the page-locked host bytes through
CUDA aliases, ktorch/ops/triton_gather.py; one DMA ``copy_`` per run of consecutive ids and packed tensor before,
which cost the launching thread ~260 ATen calls a layer) into one staging buffer per device (``DeviceStaging``:
packed bytes and dequantized weights of ``capacity`` experts, sized by the GPU memory budget), shared by the
layers, which run one after another.

Prefill only (T >= ``RoutedExperts.min_tokens``), eager only: where experts may be copied, the per-layer token
counts cost one small device to host copy and a host sync per layer, which a captured decode step must not. Where
nothing can be copied (every expert resident, or no staging) a call only records its counts on the device
(``RoutedExperts.record``: no host sync, so the launching thread runs ahead of the GPU); they are read with the
counters (after the prefill: the residents' swaps). Decode uses the resident experts directly
(ktorch/ops/gpu_experts.py) and the CPU op for the rest.

Counters per layer (``RoutedExperts.stats``, summed by ``ktorch.prefill_split_stats``): passes, experts hit,
experts copied, bytes copied, experts copied the batch did not use (0 by construction, counted anyway), rows on
each side, resident experts hit.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from ktorch.ops import triton_experts, triton_prefill
from ktorch.ops.gpu_experts import gpu_experts_forward
from ktorch.ops.streamed_experts import StreamedExperts, as_bytes, dequantize_packed, queue_timed
from ktorch.ops.triton_gather import as_words, gather_rows, kernel_runs_on, triton

MIN_TOKENS = 64  # below this a call never splits (the CPU op alone; the host sync of the counts is not worth it)
# calls whose counts wait on the device before they are read anyway: bounds the device memory they hold (a block of
# the caching allocator each, ~1.5 KB for 128 experts: 64 x 48 layers ~ 5 MB) at one host sync per 64 prefills
PENDING_LIMIT = 64
# the calibration's CPU points beside its dense ones: (experts, rows an expert) calls like the split's own (session 57,
# H200 host: a fit of dense points alone put 1.1-2.1 ms on each call where a sparse call of ~1 expert took 0.1-0.4 ms)
SPARSE_CALLS = ((1, 4), (4, 16), (8, 48))
# the split's CPU law learns from its own calls (SplitCosts.refit_cpu): the latest this many calls are fitted, every
# this many new ones, the set-up's calibration points weighted this much beside them
OBSERVED_CALLS = 256
REFIT_EVERY = 12
CALIBRATION_WEIGHT = 0.05


@dataclass
class SplitCosts:
    """Seconds per unit, measured by ``calibrate_split_costs`` (or given by hand in tests and experiments).

    Measured costs keep learning: the split's own CPU op calls are timed (``observe_cpu``, from the worker) and the
    CPU law is refitted to them (``refit_cpu``, at most every ``REFIT_EVERY`` new calls), the set-up's calibration
    points (``calibration``) kept in the fit with a small weight. The set-up's points are few and far from the calls
    a prefill makes (thousands of rows against a few hundred), so their fitted fixed cost varied between processes
    by 5x (0.7-3.9 ms a call, H200 host, session 45) and with it the split: a skewed prefill 41.5 ms in one process
    and 55.0 ms in another. Costs given by hand (no ``calibration``) are kept as given."""

    h2d_bytes_per_s: float  # the split's host-to-device gather (``gather_experts``), measured while the CPU op runs
    # (the resident swaps' DMA copies, ktorch/gpu_memory.py, take it as their rate too)
    cpu_fixed_s: float  # the CPU op per call
    cpu_row_s: float  # per (token, expert) row on the CPU
    cpu_expert_s: float  # per expert the CPU computes (its weights read once, cold)
    device_row_s: float = 0.0  # per row on the device (its GEMMs)
    device_expert_s: float = 0.0  # per copied expert on the device beyond its copy (its dequantization)
    # the set-up's CPU points (rows, experts, seconds); empty: costs given by hand, never refitted
    calibration: tuple = field(default=(), repr=False, compare=False)
    refits: int = field(default=0, compare=False)  # CPU refits made from observed calls

    def __post_init__(self):
        for name in ("h2d_bytes_per_s",):
            if not getattr(self, name) > 0:
                raise ValueError(f"SplitCosts: {name} must be > 0, got {getattr(self, name)}")
        for name in ("cpu_fixed_s", "cpu_row_s", "cpu_expert_s", "device_row_s", "device_expert_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"SplitCosts: {name} must be >= 0, got {getattr(self, name)}")
        self._observed: collections.deque = collections.deque(maxlen=OBSERVED_CALLS)  # (rows, experts, seconds)
        self._new = 0
        self._lock = threading.Lock()  # the worker thread observes, the launching thread refits

    def __getstate__(self):  # copies and pickles (a deep-copied model) hold their own lock
        state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def observe_cpu(self, rows: int, experts: int, seconds: float) -> None:
        """One CPU op call of the split as it ran (any thread): ``rows`` rows over ``experts`` experts."""
        if not self.calibration or experts <= 0 or not seconds > 0:
            return
        with self._lock:
            self._observed.append((float(rows), float(experts), float(seconds)))
            self._new += 1

    def refit_cpu(self) -> bool:
        """Refits the CPU law (fixed, row, expert) where ``REFIT_EVERY`` calls were observed since the last fit
        (``fit_cpu_law``): the observed calls (the latest ``OBSERVED_CALLS``) and the calibration points, these
        weighted ``CALIBRATION_WEIGHT``. Returns whether it refitted."""
        with self._lock:
            if self._new < REFIT_EVERY:
                return False
            self._new = 0
            observed = list(self._observed)
        weights = [1.0] * len(observed) + [CALIBRATION_WEIGHT] * len(self.calibration)
        self.cpu_fixed_s, self.cpu_row_s, self.cpu_expert_s = fit_cpu_law(observed + list(self.calibration), weights)
        self.refits += 1
        return True

    def calibrated(self) -> "SplitCosts":
        """These costs with the CPU law of the set-up's calibration alone (``fit_cpu_law`` of its points): what a
        captured prefill's choice uses. Its CPU calls run on native tasks (ktorch/compile/experts_runtime.py), as
        the calibration times the op, while the calls observed (``observe_cpu``) are eager ones, each with the
        worker's Python and GIL turns on top; and those are the warm-up's prefill of one length, whose calls of one
        shape cannot separate the law's fixed, row and expert costs (session 57: a fixed 1.1-2.1 ms a call where a
        captured call of ~1 expert took 0.1-0.4). Costs given by hand are returned as they are."""
        if not self.calibration:
            return self
        law = fit_cpu_law(self.calibration)
        return dataclasses.replace(self, cpu_fixed_s=law[0], cpu_row_s=law[1], cpu_expert_s=law[2])

    def cpu_seconds(self, rows, experts):
        """The CPU op's predicted time for ``rows`` rows over ``experts`` experts (numbers or numpy arrays); 0 where
        it computes no expert."""
        return np.where(np.asarray(experts) > 0, self.cpu_fixed_s + self.cpu_row_s * rows + self.cpu_expert_s * experts,
                        0.0)

    def device_seconds(self, copied, rows, bytes_per_expert: int):
        """The device part's predicted time: ``copied`` experts of ``bytes_per_expert`` packed bytes copied (and
        dequantized), ``rows`` rows computed there (copied and resident experts'); numbers or numpy arrays."""
        return copied * (bytes_per_expert / self.h2d_bytes_per_s + self.device_expert_s) + self.device_row_s * rows


def cpu_side(counts: np.ndarray, chosen: np.ndarray, resident: Optional[np.ndarray]) -> tuple:
    """(rows, experts) a split call leaves the CPU op: counts [E] rows per expert, chosen the copied ids, resident
    [E] bool or None."""
    on_device = np.zeros(counts.size, dtype=bool) if resident is None else resident.copy()
    on_device[chosen] = True
    return int(counts[~on_device].sum()), int(((counts > 0) & ~on_device).sum())


@dataclass
class SplitCall:
    """One split call as its costs priced it (``RoutedExperts.calls``, for benchmarks): the CPU op's rows and
    experts, the copied experts and the rows on the device (copied and resident experts'), the seconds
    ``SplitCosts`` predict for each side, and the device part's measured time once it ran (``device_measured_s``)."""

    cpu_rows: int
    cpu_experts: int
    copied: int
    device_rows: int
    cpu_s: float
    device_s: float
    device_timing: Optional[tuple] = None  # (start, end) CUDA events, or (seconds,) measured on the CPU

    @classmethod
    def of(cls, counts: np.ndarray, chosen: np.ndarray, resident: Optional[np.ndarray], costs: SplitCosts,
           bytes_per_expert: int) -> "SplitCall":
        """counts [E] rows per expert, chosen: the copied ids, resident [E] bool or None."""
        cpu_rows, cpu_experts = cpu_side(counts, chosen, resident)
        device_rows = int(counts.sum()) - cpu_rows
        return cls(cpu_rows, cpu_experts, int(chosen.size), device_rows,
                   float(costs.cpu_seconds(cpu_rows, cpu_experts)),
                   float(costs.device_seconds(chosen.size, device_rows, bytes_per_expert)))

    def timed(self, work, device: torch.device):
        """``work`` (the call's device part, a callable) timed when it runs: CUDA events on the current stream around
        it (read after a sync), or the wall time on the CPU."""
        def run():
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = work()
                end.record()
                self.device_timing = (start, end)
                return out
            t0 = time.perf_counter()
            out = work()
            self.device_timing = (time.perf_counter() - t0,)
            return out
        return run

    @property
    def device_measured_s(self) -> Optional[float]:
        """The device part's seconds (its events' interval on CUDA: synchronize first), None where none ran."""
        if self.device_timing is None:
            return None
        if len(self.device_timing) == 1:
            return self.device_timing[0]
        start, end = self.device_timing
        return start.elapsed_time(end) / 1e3


def expert_counts(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Rows per expert [E] int64 on topk_ids' device (slots < 0 are not counted). A fixed-size scatter, not
    ``torch.bincount``, whose CUDA kernel reads the ids' maximum on the host (a sync) to size its output."""
    ids = topk_ids.reshape(-1).long() + 1  # -1 -> bin 0, dropped
    bins = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
    return bins.scatter_add_(0, ids, torch.ones_like(ids))[1:]


def choose_device_experts(counts, costs: SplitCosts, bytes_per_expert: int, capacity: int,
                          resident=None) -> torch.Tensor:
    """The experts to copy to the device for one call: ids ascending, int64, on the CPU.

    counts [E] rows per expert (CPU tensor or numpy array); ``resident`` [E] bool: experts the device holds (always
    computed there, never copied). Candidates are the used, non-resident experts, most-hit first (ties: lower id);
    the first k of them are copied, k <= ``capacity`` chosen to minimise max(CPU time, device time), the smallest
    such k on a tie (fewest bytes moved). In numpy: a call runs once per MoE layer of a prefill, whose launching
    thread bounds it (E-sized arrays: numpy's ops take about a microsecond, torch's CPU ops several)."""
    counts = _numpy_int64(counts)
    E = counts.size
    on_device = np.zeros(E, dtype=bool) if resident is None else _numpy_bool(resident)
    resident_rows = int(counts[on_device].sum())
    candidates = np.flatnonzero((counts > 0) & ~on_device)
    n = candidates.size
    if n == 0 or capacity <= 0:
        return torch.zeros(0, dtype=torch.int64)
    candidates = candidates[np.argsort(-counts[candidates], kind="stable")]  # most rows first, ascending among equals
    rows = counts[candidates].astype(np.float64)
    taken = np.concatenate([np.zeros(1), np.cumsum(rows)])  # rows of the first k, k = 0..n (exact: integers)
    k = np.arange(n + 1, dtype=np.float64)
    cpu = costs.cpu_seconds(rows.sum() - taken, n - k)
    device = costs.device_seconds(k, resident_rows + taken, bytes_per_expert)
    total = np.maximum(cpu, device)[:min(capacity, n) + 1]
    best = int(np.argmin(total))  # first minimum: the smallest k
    return torch.from_numpy(np.sort(candidates[:best]).astype(np.int64))


def choose_on_device(counts: torch.Tensor, costs: SplitCosts, bytes_per_expert: int, capacity: int,
                     resident: Optional[torch.Tensor] = None) -> tuple:
    """``choose_device_experts``' choice made on the device, for a prefill captured in a CUDA graph (which can
    neither read the counts on the host nor choose in numpy): counts [E] int (rows per expert), ``resident`` [E] bool
    or None, on one device -> (slot_of [E] int64: each chosen expert's slot among the chosen, ascending ids, else -1;
    chosen [E] int64: the chosen ids ascending, then -1; k [1] int64: how many), on it, without a host sync. Tensor
    ops of [E]-sized shapes: the same candidates (used, not resident), the same order (most rows first, lower id
    among equals), the same costs in the same float64 operations, the same first minimum, so the same experts for
    any counts (tests/test_device_split.py)."""
    if counts.dim() != 1:
        raise ValueError(f"choose_on_device: counts must be [E], got {tuple(counts.shape)}")
    E = counts.numel()
    device = counts.device
    counts = counts.to(torch.int64)
    candidate = counts > 0
    if resident is not None:
        if resident.shape != counts.shape:
            raise ValueError(f"choose_on_device: resident must be [E={E}] bool, got {tuple(resident.shape)}")
        resident = resident.to(device=device, dtype=torch.bool)
        candidate = candidate & ~resident
    # most rows first, lower ids first among equals (a stable sort of -rows); the others (-rows = 1) last
    order = torch.sort(torch.where(candidate, -counts, 1), stable=True).indices
    n = candidate.sum()
    rows = torch.where(candidate, counts, 0)[order].to(torch.float64)
    taken = torch.cat([rows.new_zeros(1), torch.cumsum(rows, 0)])  # rows of the first k, k = 0..E (exact: integers)
    k = torch.arange(E + 1, device=device, dtype=torch.float64)
    cpu_experts = n.to(torch.float64) - k
    cpu_rows = rows.sum() - taken
    # SplitCosts.cpu_seconds and device_seconds, operation for operation (the same float64 roundings)
    cpu = torch.where(cpu_experts > 0,
                      costs.cpu_fixed_s + costs.cpu_row_s * cpu_rows + costs.cpu_expert_s * cpu_experts,
                      torch.zeros((), dtype=torch.float64, device=device))
    resident_rows = (torch.where(resident, counts, 0).sum() if resident is not None
                     else counts.new_zeros(())).to(torch.float64)
    per_copy = bytes_per_expert / costs.h2d_bytes_per_s + costs.device_expert_s
    device_s = k * per_copy + costs.device_row_s * (resident_rows + taken)
    total = torch.maximum(cpu, device_s)
    allowed = k <= torch.clamp(n, max=max(int(capacity), 0)).to(torch.float64)
    total = torch.where(allowed, total, torch.full((), float("inf"), dtype=torch.float64, device=device))
    best = torch.argmin(total)  # the first minimum: the smallest k
    take = torch.arange(E, device=device) < best
    chosen_mask = torch.zeros(E, dtype=torch.bool, device=device).scatter(0, order, take)
    slot_of = torch.where(chosen_mask, torch.cumsum(chosen_mask.to(torch.int64), 0) - 1, -1)
    ids = torch.arange(E, device=device)
    chosen = torch.sort(torch.where(chosen_mask, ids, E)).values
    chosen = torch.where(chosen < E, chosen, -1)
    return slot_of, chosen, best.reshape(1).to(torch.int64)


def _numpy_int64(t) -> np.ndarray:
    return t.to("cpu", torch.int64).numpy() if isinstance(t, torch.Tensor) else np.asarray(t, dtype=np.int64)


def _numpy_bool(t) -> np.ndarray:
    return t.to("cpu", torch.bool).numpy() if isinstance(t, torch.Tensor) else np.asarray(t, dtype=bool)


def contiguous_runs(ids: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted expert ids -> [(first, end)] runs of consecutive ids (end exclusive)."""
    runs: list = []
    for e in ids:
        if runs and runs[-1][1] == e:
            runs[-1] = (runs[-1][0], e + 1)
        else:
            runs.append((e, e + 1))
    return runs


def reads_blocks(layer: StreamedExperts, dtype: torch.dtype, device, kernel: str = "auto") -> bool:
    """Whether ``layer``'s copied experts run through the grouped Triton kernels on their packed blocks as copied
    (``RoutedExperts.blocks_kernels_apply``) for activations of ``dtype`` on ``device``, whatever the tile: int8
    codes whose scale groups every tile takes, an activation the kernels compute, ``kernel`` auto, CUDA and
    Triton. Then the staging needs no dequantized weights."""
    if torch.device(device).type != "cuda" or not triton_experts.triton_available():
        return False
    if kernel != "auto" or layer.activation not in triton_prefill._ACT_CODES or dtype not in (torch.bfloat16,
                                                                                            torch.float16):
        return False
    one = triton_prefill.PackedBlocks(*(None if t is None else t[:1] for t in layer.tensors))
    return triton_prefill.every_tile_takes(one)


class DeviceStaging:
    """Where copied experts land on the device: packed bytes of ``capacity`` experts (each packed tensor's rows one
    after another, 256-byte aligned) and, where the grouped kernels do not read those blocks as they are
    (``reads_blocks``: 4-bit, bf16 and MXFP4 experts), their dequantized weights (w13 as [capacity, 2I, H], w2 as
    [capacity, H, I], in ``dtype``). One per model and device; layers use it in turn (they run in stream order)."""

    def __init__(self, layer: StreamedExperts, capacity: int, device: torch.device, dtype: torch.dtype,
                 kernel: str = "auto"):
        w13, _, w2, _ = layer.tensors
        self.capacity, self.device, self.dtype = capacity, torch.device(device), dtype
        self.packed = torch.empty(layer.prefix_bytes(capacity) if capacity else 0, dtype=torch.uint8, device=device)
        two_i, h = w13.shape[1] * 16, w2.shape[1] * 16
        dequantized = 0 if reads_blocks(layer, dtype, device, kernel) else capacity
        self.w13 = torch.empty(dequantized, two_i, h, dtype=dtype, device=device)
        self.w2 = torch.empty(dequantized, h, two_i // 2, dtype=dtype, device=device)
        self._views: dict = {}  # (k, a layer's layout) -> (views_in's views, their [k, W] word views): views_for
        self._layouts: dict = {}  # id(layer) -> (a weak reference to it, its layout): views_for

    def views_for(self, layer: StreamedExperts, k: int, words: Sequence[Optional[torch.Tensor]]) -> tuple:
        """(``layer.views_in(self.packed, k)``, the same views as [k, W] words of ``words``' dtypes (the layer's
        ``gather_sources``)): made once per k and layout (the layers of a model share them), since a call's few
        microseconds of view ops add up over the layers of a launch-bound prefill."""
        known = self._layouts.get(id(layer))
        if known is None or known[0]() is not layer:  # a layer's layout is the same every call (its words too)
            layout = tuple(None if t is None else (t.dtype, tuple(t.shape[1:]), w.dtype)
                           for t, w in zip(layer.tensors, words))
            known = self._layouts[id(layer)] = (weakref.ref(layer), layout)
        key = (k, known[1])
        made = self._views.get(key)
        if made is None:
            views = layer.views_in(self.packed, k)
            made = self._views[key] = (views, tuple(None if v is None else as_words(v, w.dtype)
                                                    for v, w in zip(views, words)))
        return made

    def dequantized_out(self, k: int, dtype: torch.dtype) -> tuple:
        """(w13 [k, 2I, H], w2 [k, H, I]) buffers of ``dtype`` that ``dequantize_packed`` writes k copied experts'
        weights into: the staging's own, or, where it holds fewer or of another dtype (sized for the blocks'
        kernels, ``reads_blocks``, which need none), fresh ones for this call."""
        if self.w13.shape[0] >= k and self.w13.dtype == dtype:
            return self.w13[:k], self.w2[:k]
        two_i, h = self.w13.shape[1:]
        return (torch.empty(k, two_i, h, dtype=dtype, device=self.device),
                torch.empty(k, h, two_i // 2, dtype=dtype, device=self.device))

    @staticmethod
    def bytes_for(layer: StreamedExperts, capacity: int, dtype: torch.dtype, device="cuda", kernel: str = "auto") -> int:
        """Device bytes a staging of ``capacity`` experts of ``layer``'s shape takes on ``device``."""
        w13, w2 = layer.tensors[0], layer.tensors[2]
        two_i, h = w13.shape[1] * 16, w2.shape[1] * 16
        size = torch.empty((), dtype=dtype).element_size()
        dequantized = 0 if reads_blocks(layer, dtype, device, kernel) else capacity
        return (layer.prefix_bytes(capacity) if capacity else 0) + dequantized * (two_i * h + h * (two_i // 2)) * size

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.w13, self.w2))

    def fits(self, layer: StreamedExperts) -> bool:
        w13, w2 = layer.tensors[0], layer.tensors[2]
        return (self.w13.shape[1:] == (w13.shape[1] * 16, w2.shape[1] * 16)
                and self.packed.numel() >= (layer.prefix_bytes(self.capacity) if self.capacity else 0))


class RoutedExperts:
    """One MoE layer's routing-aware split: its page-locked packed experts (``StreamedExperts``), the costs that
    decide the split, the device staging its copies go to, its counters and its routing frequency."""

    def __init__(self, layer: StreamedExperts, costs: SplitCosts, staging: Optional[DeviceStaging],
                 min_tokens: int = MIN_TOKENS, kernel: str = "auto"):
        if staging is not None and not staging.fits(layer):
            raise ValueError("RoutedExperts: the staging was made for another expert shape")
        self.layer, self.costs, self.staging, self.min_tokens, self.kernel = layer, costs, staging, min_tokens, kernel
        self._stats: collections.Counter = collections.Counter()
        self._last_hit = 0
        self._frequency = torch.zeros(layer.num_experts, dtype=torch.float64)
        # calls counted on the device and not yet read (``record``): (counts [E] on the device, resident ids or None)
        self._pending: list = []
        self._resident_cache: Optional[tuple] = None  # (the residents' id list, its length, its [E] bool mask)
        self.bytes_per_expert = layer.bytes_per_expert()  # packed bytes an expert copied moves
        # None, or a list (benchmarks set it, layers may share one) to which each ``choose`` appends its SplitCall:
        # what the costs predicted, and the device part's time measured (``SplitCall.timed``)
        self.calls: Optional[list] = None
        self._cpu_call: Optional[tuple] = None  # (rows, experts) the latest choice left the CPU op (cpu_observer)
        self._blocks_apply: dict = {}  # (dtype, device, on the kernels' device, tile) -> blocks_kernels_apply's answer

    # The counters below are read rarely (after a prefill, by the residents' swaps and the statistics); a call that
    # copies nothing records its counts on the device (``record``) and they are added here on the first read after,
    # in call order: the same values as counting each call on the host, with one host sync per read, not per layer.

    @property
    def stats(self) -> collections.Counter:
        """passes, experts_hit, experts_copied, bytes_copied, copied_unused, rows, rows_copied, resident_hit,
        rows_resident, summed over calls."""
        self._count_pending()
        return self._stats

    @property
    def last_hit(self) -> int:
        """Distinct experts the latest split call used."""
        self._count_pending()
        return self._last_hit

    @last_hit.setter
    def last_hit(self, value: int) -> None:
        self._count_pending()
        self._last_hit = value

    @property
    def frequency(self) -> torch.Tensor:
        """Rows per expert [E] float64 (CPU), prefills summed (the residents' swaps scale it in place)."""
        self._count_pending()
        return self._frequency

    @frequency.setter
    def frequency(self, value: torch.Tensor) -> None:  # ``routed.frequency *= x`` sets it back after the product
        self._count_pending()
        self._frequency = value

    @property
    def num_experts(self) -> int:
        return self.layer.num_experts

    @property
    def capacity(self) -> int:
        return 0 if self.staging is None else self.staging.capacity

    def copies_possible(self, resident_ids: Optional[Sequence[int]]) -> bool:
        """Whether a call may copy experts: a staging to copy into, and experts not resident. Where not, the split
        has nothing to decide, and a call only ``record``s its counts (no host sync)."""
        return self.capacity > 0 and len(resident_ids or ()) < self.num_experts

    def record(self, counts: torch.Tensor, resident_ids: Optional[Sequence[int]] = None,
               chosen: Optional[torch.Tensor] = None) -> None:
        """Counts a call from its rows per expert ``counts`` [E] int64 on any device, without reading them now;
        ``resident_ids``: the experts resident during the call (a list the caller does not change afterwards);
        ``chosen``: the experts it copied, [E] ids padded with -1 on the counts' device (a captured split's), or None
        (none). Read by the counters' next access (at the latest every ``PENDING_LIMIT`` calls)."""
        self._pending.append((counts, chosen, resident_ids))
        if len(self._pending) >= PENDING_LIMIT:
            self._count_pending()

    def _count_pending(self) -> None:
        pending, self._pending = self._pending, []
        if not pending:
            return
        empty = np.zeros(0, dtype=np.int64)
        # the one host sync: every call's counts, and the copied ids of those that were given them
        rows = torch.stack([c.to(torch.int64) for c, _, _ in pending] + [c.to(torch.int64) for _, c, _ in pending
                                                                          if c is not None]).cpu().numpy()
        given = iter(rows[len(pending):])
        for counts, (_, chosen, ids) in zip(rows, pending):
            copied = empty if chosen is None else next(given)
            self._count(counts, copied[copied >= 0], self.resident_mask(ids))

    def resident_mask(self, resident_ids: Optional[Sequence[int]]) -> Optional[np.ndarray]:
        """[E] bool of the experts ``resident_ids`` (None for none), cached for the list last asked about (the
        module's list of residents changes only by replacement, at a swap)."""
        if not resident_ids:
            return None
        cached = self._resident_cache
        if cached is None or cached[0] is not resident_ids or cached[1] != len(resident_ids):
            mask = np.zeros(self.num_experts, dtype=bool)
            mask[np.asarray(resident_ids, dtype=np.int64)] = True
            cached = self._resident_cache = (resident_ids, len(resident_ids), mask)
        return cached[2]

    def choose(self, counts, resident=None) -> torch.Tensor:
        """The experts to copy for a call with these per-expert rows (CPU tensor or numpy array; ``resident`` [E]
        bool, tensor or array), counted in ``stats``."""
        self._count_pending()
        self.costs.refit_cpu()  # from the CPU calls observed so far (a no-op until enough are new)
        counts = _numpy_int64(counts)
        resident = None if resident is None else _numpy_bool(resident)
        chosen = choose_device_experts(counts, self.costs, self.bytes_per_expert, self.capacity, resident)
        ids = chosen.numpy()
        self._count(counts, ids, resident)
        self._cpu_call = cpu_side(counts, ids, resident)
        if self.calls is not None:
            self.calls.append(SplitCall.of(counts, ids, resident, self.costs, self.bytes_per_expert))
        return chosen

    def cpu_observer(self):
        """For the CPU op call that follows a ``choose``: a callable taking that call's seconds, which the costs
        learn from (``SplitCosts.observe_cpu``); None where no choice is pending or it left the CPU no expert. Each
        choice is taken once."""
        shape, self._cpu_call = self._cpu_call, None
        if shape is None or shape[1] == 0:
            return None
        costs = self.costs
        return lambda seconds: costs.observe_cpu(shape[0], shape[1], seconds)

    def _count(self, counts: np.ndarray, chosen: np.ndarray, resident: Optional[np.ndarray]) -> None:
        hit = counts > 0
        self._last_hit = int(hit.sum())
        self._frequency += torch.from_numpy(counts.astype(np.float64))
        s = self._stats
        s["passes"] += 1
        s["experts_hit"] += self._last_hit
        s["experts_copied"] += int(chosen.size)
        s["bytes_copied"] += int(chosen.size) * self.bytes_per_expert
        s["copied_unused"] += int((counts[chosen] == 0).sum())
        s["rows"] += int(counts.sum())
        s["rows_copied"] += int(counts[chosen].sum())
        if resident is not None:
            s["resident_hit"] += int((hit & resident).sum())
            s["rows_resident"] += int(counts[resident].sum())

    def blocks_kernels_apply(self, hidden: torch.Tensor, blocks, tile: Optional[tuple] = None) -> bool:
        """Whether the copied experts run through the grouped Triton kernels reading their packed blocks as copied
        (ktorch/ops/triton_prefill.py, ``PackedBlocks``: int8 codes, bf16/fp16 activations, CUDA, ``kernel`` auto)
        rather than dequantized to the staging's weights and ``gpu_experts_forward``. Session 35: the dequantized
        path was ~50 launches a layer of an eager prefill bound by its launching thread, and its dequantization the
        largest kernel time after the copies."""
        return (self.kernel == "auto" and self.layer.activation in triton_prefill._ACT_CODES
                and triton_prefill.grouped_applies(hidden, blocks, tile))

    def captured_split(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                       counts: torch.Tensor, resident: Optional[torch.Tensor]) -> tuple:
        """The split as a captured prefill runs it, every step device work of fixed shapes (no host sync):
        ``choose_on_device`` makes ``choose``'s choice from ``counts`` [E] (rows per expert, on the device) and
        ``resident`` [E] bool (or None); the chosen experts' packed blocks are gathered into the staging's first k
        of its ``capacity`` rows (the rest of the chosen ids are -1, skipped), and the grouped kernels run over the
        ``capacity`` experts (rows routed only to the first k). topk_ids [T, K] has the resident experts masked
        already. Returns (ids for the CPU op [T, K], a callable computing the copied experts' part [T, H], the chosen
        ids [E] padded with -1, for the counters). Where ``captured_split_problem`` is None only."""
        capacity = min(self.capacity, self.num_experts)
        slot_of, chosen, _ = choose_on_device(counts, self.costs.calibrated(), self.bytes_per_expert, capacity,
                                              resident)
        slots, cpu_ids = route_by_slots(topk_ids, slot_of)
        layer, staging = self.layer, self.staging

        def work() -> torch.Tensor:
            words = layer.gather_sources(hidden.device)
            views, dsts = staging.views_for(layer, capacity, words)
            gather_rows(dsts, words, chosen[:capacity])
            blocks = triton_prefill.PackedBlocks(*views)
            tile = triton_prefill.tile_for(topk_ids.numel() / self.num_experts)
            return triton_prefill.triton_grouped_forward(hidden, slots, topk_weights, blocks, layer.activation, tile)

        return cpu_ids, work, chosen

    def captured_split_problem(self, hidden_dtype: torch.dtype, device: torch.device) -> Optional[str]:
        """Why ``captured_split`` cannot run this layer's copies (None where it can): the copied experts must be read
        as packed blocks by the grouped kernels (``reads_blocks``: int8 codes, bf16/fp16 activations, CUDA, Triton),
        their sources aliased for the zero-copy gather, and the layer page-locked."""
        if not reads_blocks(self.layer, hidden_dtype, device, self.kernel):
            return "its copied experts are not int8 blocks the grouped kernels read as copied"
        if self.layer.gather_sources(torch.device(device)) is None:
            return "its packed experts cannot be read in place by the gather (no page-locked aliases)"
        if self.layer.pinned_experts < self.num_experts:
            return "its packed experts are not page-locked"
        return None

    def device_part(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    chosen: torch.Tensor, slots: Optional[torch.Tensor] = None) -> torch.Tensor:
        """hidden [T, H], topk_ids/topk_weights [T, K] on the device; the routed output [T, H] of the experts
        ``chosen`` (sorted ids, CPU): their packed bytes gathered into the staging (``gather_experts``), then int8
        blocks read as they are by the grouped kernels (``blocks_kernels_apply``), other formats dequantized there
        and computed with ``gpu_experts_forward`` (slots of other experts skipped). ``slots``: ``route_for``'s,
        when the caller has them already."""
        k = chosen.numel()
        if k > self.capacity:
            raise ValueError(f"routed experts: {k} experts chosen, the staging holds {self.capacity}")
        staging = self.staging
        device = hidden.device
        if device.type == "cuda" and self.layer.pinned_experts < self.num_experts:
            raise RuntimeError("routed experts: the layer's packed experts are not page-locked; pin_prefix(E) first")
        views = gather_experts(self.layer, staging, chosen, _to_device(chosen, device))
        if slots is None:
            slots = route_for(topk_ids, chosen, self.num_experts)[0]
        blocks = triton_prefill.PackedBlocks(*views)
        tile = triton_prefill.tile_for(topk_ids.numel() / self.num_experts)
        # the layer's formats and kernel are fixed: asked once per dtype, device (and whether Triton interprets) and tile
        applies_key = (hidden.dtype, hidden.device, triton_prefill.on_kernel_device(hidden), tile)
        applies = self._blocks_apply.get(applies_key)
        if applies is None:
            applies = self._blocks_apply[applies_key] = self.blocks_kernels_apply(hidden, blocks, tile)
        if applies:  # int8 codes: read as copied, no dequantized copy
            return triton_prefill.triton_grouped_forward(hidden, slots, topk_weights, blocks, self.layer.activation,
                                                         tile)
        w13_out, w2_out = staging.dequantized_out(k, hidden.dtype)
        w13 = dequantize_packed(views[0], views[1], True, hidden.dtype, out=w13_out)
        w2 = dequantize_packed(views[2], views[3], False, hidden.dtype, out=w2_out)
        return gpu_experts_forward(hidden, slots, topk_weights, w13, w2, self.layer.activation, self.kernel)


def route_for(topk_ids: torch.Tensor, chosen: torch.Tensor, num_experts: int) -> tuple:
    """(slots [T, K] int64: each pair's index among the experts ``chosen`` (sorted CPU ids), -1 for the others;
    cpu_ids [T, K]: topk_ids with those pairs set to -1, what the CPU op gets beside them). One Triton launch on
    CUDA (``triton_experts.triton_route``, as the residents' split), a few ATen ops elsewhere."""
    chosen = _numpy_int64(chosen)
    slot_of = np.full(num_experts, -1, dtype=np.int64)
    slot_of[chosen] = np.arange(chosen.size)
    return route_by_slots(topk_ids, _to_device(torch.from_numpy(slot_of), topk_ids.device))


def route_by_slots(topk_ids: torch.Tensor, slot_of: torch.Tensor) -> tuple:
    """``route_for`` from ``slot_of`` [E] int64 on topk_ids' device (each expert's slot, or -1): (slots, cpu_ids)."""
    if triton_experts.route_applies(topk_ids):
        return triton_experts.triton_route(topk_ids, slot_of)
    slots = torch.where(topk_ids >= 0, slot_of[topk_ids.clamp(min=0).long()], -1)
    return slots, torch.where(slots >= 0, -1, topk_ids)


def gather_experts(layer: StreamedExperts, staging: DeviceStaging, chosen: torch.Tensor, ids: torch.Tensor) -> tuple:
    """Queues the copy of ``layer``'s experts ``chosen`` (sorted ids [k], CPU; ``ids`` the same on the staging's
    device) into ``staging.packed``, expert j of the call in row j; returns their views there (``views_in``). On
    CUDA one zero-copy gather launch (ktorch/ops/triton_gather.py: the SMs read the page-locked host bytes through
    their aliases, ``StreamedExperts.gather_sources``) whatever the runs of ids; on the CPU ``index_select`` (or
    the same kernel under Triton's interpreter). Where the sources cannot be aliased (``gather_sources`` None) or
    Triton is missing on CUDA, the per-run copies (``_copy_expert_runs``). benchmarks/bench_generate.py's "dma
    runs" prefill variant swaps this function for ``_copy_expert_runs``."""
    words = layer.gather_sources(ids.device)
    if words is None or (ids.is_cuda and triton is None):
        return _copy_expert_runs(layer, staging, chosen, ids)
    views, dsts = staging.views_for(layer, chosen.numel(), words)
    if kernel_runs_on(ids):
        gather_rows(dsts, words, ids)
    else:
        for dst, src in zip(dsts, words):
            if src is not None:
                torch.index_select(src, 0, ids, out=dst)
    return views


def _copy_expert_runs(layer: StreamedExperts, staging: DeviceStaging, chosen: torch.Tensor,
                      ids: torch.Tensor) -> tuple:
    """``gather_experts`` as DMA: one non-blocking ``copy_`` per contiguous run of ``chosen`` ids and packed tensor
    (~20 runs x 4 tensors a Qwen3-30B-A3B layer at 512 tokens, ~80 copies and ~180 slices on the launching thread).
    The fallback where the sources cannot be aliased. On the clock it tied the gather (device, session 35 call 3,
    H200 host, 48 layers, --prefill-variants default "dma runs": off P=512/2048 355.5/481.5 ms gather against
    340.0/510.8 runs, 24GiB 213.0/316.2 against 219.5/306.0; both at ~48 GB/s) with ~8000 more ATen ops a prefill."""
    views = layer.views_in(staging.packed, chosen.numel())
    j = 0
    for a, b in contiguous_runs(chosen.tolist()):
        for dst, src in zip(views, layer.sources):
            if dst is not None:
                as_bytes(dst)[j:j + b - a].copy_(as_bytes(src[a:b]), non_blocking=True)
        j += b - a
    return views


def cpu_ids_for(topk_ids: torch.Tensor, chosen: torch.Tensor, num_experts: int) -> torch.Tensor:
    """topk_ids with the slots of the experts ``chosen`` (CPU ids) set to -1: what the CPU op gets beside them."""
    return route_for(topk_ids, chosen, num_experts)[1]


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device`` without a host sync: through (cached) page-locked memory on CUDA."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


# ---------------------------------------------------------------- measuring the costs


def _cpu_op(layer: StreamedExperts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
    """The CPU op as the calibration times it (tests replace it with a known law)."""
    torch.ops.kt.fused_moe(x, ids, weights, *layer.tensors, layer.activation)


def fit_cpu_law(points: Sequence, weights: Optional[Sequence[float]] = None) -> tuple:
    """(fixed, row_s, expert_s) of the CPU law fixed + row_s * rows + expert_s * experts, fitted to ``points``
    [(rows, experts, seconds)] by least squares of the relative error (each residual over its point's seconds,
    times its weight: calls of tenths of a millisecond count as much as dense ones of tens, which an absolute fit
    let pass with errors of their own size); a coefficient that comes out negative is dropped (0) and the others
    refitted."""
    p = np.asarray(points, dtype=np.float64).reshape(-1, 3)
    w = np.ones(len(p)) if weights is None else np.asarray(weights, dtype=np.float64)
    w = w / np.maximum(p[:, 2], 1e-12)
    features = np.column_stack([np.ones(len(p)), p[:, 0], p[:, 1]]) * w[:, None]
    seconds = p[:, 2] * w
    kept = [0, 1, 2]
    coef = np.zeros(3)
    while kept:
        solution = np.linalg.lstsq(features[:, kept], seconds, rcond=None)[0]
        if (solution >= 0).all():
            coef[kept] = solution
            break
        kept = [c for c, v in zip(kept, solution) if v >= 0]
    return tuple(float(c) for c in coef)


def calibrate_split_costs(layers: Sequence[StreamedExperts], hidden_size: int, top_k: int, device: torch.device,
                          tokens: Sequence[int] = (256, 1024), repeats: int = 2) -> SplitCosts:
    """Measures the split's costs on ``layers`` (packed experts of one shape; a CUDA ``device`` needs them
    page-locked) and returns them.

    CPU: the op at each of ``tokens`` with every expert used and with a quarter of them (random ids), and in calls
    like the split's own (``SPARSE_CALLS``: a few experts with a few rows each, the other rows unrouted), fitted to
    fixed + row_s * rows + expert_s * experts (``fit_cpu_law``), each point the mean of ``repeats`` runs;
    each run reads another layer's weights than the run before it (cold weights, as in a prefill, where each
    layer's experts were last read a whole forward ago). The split's copies (``gather_experts`` of a few experts
    spread over the layer: on CUDA the zero-copy gather from page-locked memory) run on a side stream meanwhile
    (they share the DRAM) and give the H2D rate. Device (CUDA events: the device's time, not the launching
    thread's, which put 146-165 ns on a row where a captured prefill's grouped kernels took ~50, session 57): the
    dequantization of a few experts and a grouped GEMM over many rows, less their gather timed alone. About
    ``2 * repeats * sum(tokens) * 2`` tokens of dense CPU work and a few small calls."""
    device = torch.device(device)
    first = layers[0]
    E = first.num_experts
    probe = min(E, 8)
    cuda = device.type == "cuda"
    side = torch.cuda.Stream(device) if cuda else None
    gen = torch.Generator().manual_seed(0)
    turn = [0]
    # the copies timed are what the split runs (``gather_experts``): ``probe`` experts spread over the layer, all
    # four packed tensors, into a staging of that many
    staging = DeviceStaging(first, probe, device, torch.bfloat16)
    spread = torch.sort(torch.randperm(E, generator=gen)[:probe]).values
    spread_ids = _to_device(spread, device)
    copy_bytes = probe * first.bytes_per_expert()

    def run_cpu(x, ids, weights) -> float:  # the mean of ``repeats`` runs
        times = []
        for _ in range(repeats):
            layer = layers[turn[0] % len(layers)]
            turn[0] += 1
            start = time.perf_counter()
            _cpu_op(layer, x, ids, weights)
            times.append(time.perf_counter() - start)
        return sum(times) / len(times)

    def copies(n: int):
        if not cuda:
            start = time.perf_counter()
            for _ in range(n):
                gather_experts(first, staging, spread, spread_ids)
            return time.perf_counter() - start
        # (the module's gather_experts at each call: a benchmark's variant that swaps it is timed as it runs)
        return queue_timed(lambda: gather_experts(first, staging, spread, spread_ids), n, side)

    if cuda:
        side.wait_stream(torch.cuda.current_stream(device))  # the ids' copy
        copies(2)
        side.synchronize()
    points, copied_s, copied_bytes = [], 0.0, 0
    shapes = [(used, None) for used in (E, max(top_k, E // 4))]
    # the split's own CPU calls: a few tail experts with a few rows each among T mostly unrouted rows
    shapes += [(min(used, E), per) for used, per in SPARSE_CALLS]
    for used, per in shapes:
        for T in tokens:
            x = torch.randn(T, hidden_size, dtype=torch.bfloat16, generator=gen)
            pick = torch.randperm(E, generator=gen)[:used]
            if per is None:  # every row routed, over ``used`` experts
                ids = torch.stack([pick[torch.randperm(used, generator=gen)[:top_k]]
                                   for _ in range(T)]).to(torch.int32)
            else:  # ``per`` rows an expert, each expert in its own slot of distinct tokens
                ids = torch.full((T, top_k), -1, dtype=torch.int32)
                for i, e in enumerate(pick.tolist()):
                    slot = ids[:, i % top_k]
                    free = torch.nonzero(slot < 0).flatten()
                    slot[free[torch.randperm(free.numel(), generator=gen)[:min(per, T)]]] = e
            weights = torch.full((T, top_k), 1.0 / top_k)
            alone = run_cpu(x, ids, weights)  # also the warm-up
            if cuda:
                n = max(1, round(alone * repeats * 2.5e10 / max(copy_bytes, 1)))  # about as long as the CPU calls
                begin, end = copies(n)
                seconds = run_cpu(x, ids, weights)
                side.synchronize()
                copied_s += begin.elapsed_time(end) / 1e3
                copied_bytes += n * copy_bytes
            else:
                seconds = run_cpu(x, ids, weights)
            rows = int((ids >= 0).sum())
            points.append((rows, ids[ids >= 0].unique().numel(), seconds))
    if not cuda:
        copied_s, copied_bytes = copies(4), 4 * copy_bytes
    fixed, row_s, expert_s = fit_cpu_law(points)
    # device: dequantize ``probe`` experts, then a grouped GEMM of T*K rows over them
    T = max(tokens)
    hidden = torch.randn(T, hidden_size, dtype=torch.bfloat16, device=device)
    ids = torch.randint(0, probe, (T, top_k), device=device)
    weights = torch.full((T, top_k), 1.0 / top_k, device=device)
    routed = RoutedExperts(first, SplitCosts(1.0, 0, 0, 0), staging)
    chosen = torch.arange(probe)

    def device_seconds(fn) -> float:  # the device's time (CUDA events), not the launching thread's
        fn()
        if cuda:
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    views = first.views_in(staging.packed, probe)
    dequant_s = 0.0  # the copied blocks read as they are: nothing dequantized
    if not routed.blocks_kernels_apply(hidden, triton_prefill.PackedBlocks(*views)):
        w13_out, w2_out = staging.dequantized_out(probe, torch.bfloat16)
        dequant_s = device_seconds(lambda: (
            dequantize_packed(views[0], views[1], True, torch.bfloat16, out=w13_out),
            dequantize_packed(views[2], views[3], False, torch.bfloat16, out=w2_out)))
    chosen_on_device = _to_device(chosen, device)
    gather_s = device_seconds(lambda: gather_experts(first, staging, chosen, chosen_on_device))  # alone
    total_s = device_seconds(lambda: routed.device_part(hidden, ids, weights, chosen))
    row_device_s = max(total_s - dequant_s - gather_s, 0.0) / (T * top_k)
    return SplitCosts(copied_bytes / copied_s, fixed, row_s, expert_s, row_device_s, dequant_s / probe,
                      calibration=tuple(points))
