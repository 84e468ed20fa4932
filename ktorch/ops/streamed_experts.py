"""Prefill with the GPU's help: a share of a layer's CPU-resident experts streamed to the accelerator per call.

A long prompt routes tokens to nearly every expert of a layer, so the CPU op must read all of the layer's expert
weights once per call (Qwen3-30B-A3B, int8: 604 MB a layer), at DRAM speed or at the AMX units' speed, whichever
is slower. Meanwhile the GPU idles. ``StreamedExperts`` lets it take the experts ``[0, n)`` of the layer: their
packed bytes are copied host-to-device (from page-locked memory, so the copy runs on the DMA engines while the CPU
computes the other experts), dequantized there and run through ``gpu_experts_forward``; the CPU op gets their slots
masked to -1. Both parts run at once and are summed: the layer costs max(CPU on E - n experts, copy of n experts)
instead of CPU on E. llama.cpp does the opposite extreme for large batches (every expert to the GPU); decode,
where a token reads 8 experts, never streams (the copy would be slower than the CPU reading them).

The share depends on the prompt length T: ``StreamPlan`` maps T to n (a table given by hand). The experts always
form a prefix of the packed tensors, so each copy is one contiguous range per tensor. This fixed prefix is kept for
comparison with what ``stream_experts="auto"`` runs now, the routing-aware split (ktorch/ops/routed_experts.py),
which copies only the experts a call uses, most-hit first; ``dequantize_packed`` serves both.

The device part is the custom op ``torch.ops.ktorch.streamed_experts(hidden, topk_ids, topk_weights, handle, n,
activation, kernel)``: the packed CPU tensors stay out of the graph (``handle`` indexes this module's registry,
as the compile backend does for the CPU op's weights), so a compiled graph holds device tensors only and
Inductor's CUDA graphs take it; the copies from page-locked memory are captured as memcpy nodes.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from ktorch.ops.gpu_experts import gpu_experts_forward

# dequantize_packed lives in packed_weights.py (gpu_experts uses it too); re-exported here
from ktorch.ops.packed_weights import as_bytes, dequantize_packed  # noqa: E402,F401

# ---------------------------------------------------------------- which experts stream, by prompt length


@dataclass
class StreamPlan:
    """Experts streamed to the device per call, by token count: the entry with the largest ``min_tokens <= T``.

    ``thresholds`` ascending token counts, ``experts`` the number of experts (a prefix of the layer's) streamed at
    and above each; below the first threshold nothing streams."""

    thresholds: list = field(default_factory=list)
    experts: list = field(default_factory=list)

    def experts_for(self, tokens: int) -> int:
        n = 0  # a plain loop, which Dynamo folds for a static T (and guards on for a dynamic one)
        for threshold, experts in zip(self.thresholds, self.experts):
            if tokens >= threshold:
                n = experts
        return n

    @property
    def max_experts(self) -> int:
        return max(self.experts, default=0)

    @classmethod
    def from_table(cls, table: dict, num_experts: int) -> "StreamPlan":
        """{min_tokens: experts (int) or fraction of the layer's experts (float in [0, 1])}."""
        items = sorted(table.items())
        thresholds, experts = [], []
        for tokens, share in items:
            if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
                raise ValueError(f"stream_experts: token thresholds must be ints >= 1, got {tokens!r}")
            if isinstance(share, float):
                if not 0.0 <= share <= 1.0:
                    raise ValueError(f"stream_experts: a fraction must be in [0, 1], got {share} at {tokens} tokens")
                share = round(share * num_experts)
            if isinstance(share, bool) or not isinstance(share, int) or not 0 <= share <= num_experts:
                raise ValueError(f"stream_experts: at {tokens} tokens, {share!r} is not a count in [0, {num_experts}] "
                                 "or a fraction")
            thresholds.append(tokens)
            experts.append(share)
        return cls(thresholds, experts)


def parse_stream_plan(text: str):
    """'off' | 'auto' | 'MIN_TOKENS:SHARE,...' (SHARE a fraction or an expert count, e.g. '512:0.4,2048:0.45') ->
    what ``ktorch.set_stream_experts`` takes; ValueError naming the item that is neither."""
    text = text.strip()
    if text in ("off", "auto"):
        return text
    table = {}
    for item in text.split(","):
        try:
            tokens, share = item.split(":")
            table[int(tokens)] = float(share) if "." in share else int(share)
        except ValueError:
            raise ValueError(f"expected off, auto or MIN_TOKENS:SHARE,... (e.g. 512:0.4,2048:0.45), got {item!r}") from None
    return table


# ---------------------------------------------------------------- the streamed experts of one layer


def _unregister(pointers: list) -> None:
    """Unregisters (``cudaHostUnregister``) and forgets the pointers ``pin_prefix`` page-locked in place."""
    if pointers:
        cudart = torch.cuda.cudart()
        for ptr in pointers:
            cudart.cudaHostUnregister(ptr)
        pointers.clear()


class StreamedExperts:
    """One layer's packed CPU experts, of which a prefix is copied to the device and computed there per call."""

    # A tensor at least this large came from its own mmap (glibc's largest dynamic mmap threshold is 32 MiB), so
    # page-locking it in place cannot collide with another registration on a shared page; smaller ones (scales,
    # tiny models) are copied into torch's pinned memory instead.
    REGISTER_IN_PLACE_BYTES = 32 << 20

    def __init__(self, w13: torch.Tensor, w13_scales: Optional[torch.Tensor], w2: torch.Tensor,
                 w2_scales: Optional[torch.Tensor], activation: str, kernel: str = "auto"):
        self.tensors = (w13, w13_scales, w2, w2_scales)
        self.sources = self.tensors  # what the copies read: the tensors, or page-locked copies of their prefix
        self.pinned_experts = 0
        self.activation = activation
        self.kernel = kernel
        self._registered: list = []  # pointers page-locked in place by pin_prefix
        # device -> the packed tensors as [E, W] words a gather there reads (CUDA: aliases of the page-locked
        # sources), or None; emptied whenever the pinning changes, so no alias outlives its registration
        self._gather_sources: dict = {}
        # unregistered when this object goes (its tensors are freed after): memory freed while still registered
        # leaves the range registered in the driver, and a later allocation at those addresses (the next model
        # loaded in the process) then fails its copies to the GPU ("CUDA error: invalid argument")
        weakref.finalize(self, _unregister, self._registered)
        # copies queued a layer ahead (link_streamed_layers): the plan, the next layer, the device's CopyAhead
        self.plan: Optional[StreamPlan] = None
        self.next_layer: Optional["StreamedExperts"] = None
        self.copy_ahead: Optional["CopyAhead"] = None

    @property
    def num_experts(self) -> int:
        return self.tensors[0].shape[0]

    def bytes_per_expert(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.tensors if t is not None)

    def pin_prefix(self, n: int) -> None:
        """Page-locks the first ``n`` experts of every packed tensor, so that their copies to the GPU are
        asynchronous DMA and can be captured in CUDA graphs: large tensors in place (``cudaHostRegister``), small
        ones as a pinned copy of the prefix. Raises if CUDA refuses."""
        self.unpin()
        if n <= 0:
            return
        cudart = torch.cuda.cudart()
        sources = []
        for t in self.tensors:
            if t is None:
                sources.append(None)
                continue
            nbytes = t[:n].numel() * t.element_size()
            if nbytes < self.REGISTER_IN_PLACE_BYTES:
                sources.append(as_bytes(t[:n]).pin_memory().view(t.dtype))
                continue
            err = int(cudart.cudaHostRegister(t.data_ptr(), nbytes, 0))
            if err != 0:
                raise RuntimeError(f"stream_experts: cudaHostRegister of {nbytes} bytes failed (cudaError {err}); the "
                                   "streamed experts must be page-locked (check `ulimit -l` and free memory)")
            self._registered.append(t.data_ptr())
            sources.append(t)
        self.sources = tuple(sources)
        self.pinned_experts = n

    def unpin(self) -> None:
        self.next_layer = self.copy_ahead = None  # (their device buffers go with the last layer that holds them)
        if any(d.type == "cuda" and w is not None for d, w in self._gather_sources.items()):
            torch.cuda.synchronize()  # no gather still reading through an alias when its memory is unregistered
        self._gather_sources.clear()  # the aliases before the registration they read through
        _unregister(self._registered)
        self.sources = self.tensors
        self.pinned_experts = 0

    def device_weights(self, n: int, device: torch.device, dtype: torch.dtype,
                       tokens: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [n, H, 2I], w2 [n, I, H]) of experts [0, n) on ``device`` in ``dtype``: copied (non-blocking from
        page-locked memory) and dequantized there. With ``CopyAhead`` and ``tokens`` (the call's T), the next
        layer's copy is queued between this layer's copy and its dequantization, so that the copy engines work
        through the dequantization and the GEMMs."""
        if device.type == "cuda" and n > self.pinned_experts:
            raise RuntimeError(f"streamed_experts: {n} experts asked, {self.pinned_experts} page-locked; call "
                               "pin_prefix(n) first (attach_streamed_experts does)")
        ahead = self.copy_ahead
        if ahead is not None and device == ahead.device:
            w13, s13, w2, s2 = ahead.take(self, n)
            if tokens is not None:
                ahead.queue_next(self, tokens)
        else:
            w13, s13, w2, s2 = (None if t is None else as_bytes(t[:n]).to(device, non_blocking=True).view(t.dtype)
                                for t in self.sources)
        return dequantize_packed(w13, s13, True, dtype), dequantize_packed(w2, s2, False, dtype)

    def gather_sources(self, device: torch.device) -> Optional[tuple]:
        """(w13, w13_scales, w2, w2_scales) as [E, W] words (``triton_gather.word_dtype``: the widest the row bytes
        and addresses allow; None entries kept) that a gather of experts onto ``device`` reads: on CUDA, aliases of
        the page-locked sources (``triton_gather.host_alias``: the device reads the host bytes in place; every
        expert must be page-locked), on the CPU word views of the tensors. None where that is not possible (a
        tensor not contiguous, not every expert page-locked, or the pointer not mapped on ``device``): the caller
        copies then. Made once per device and cached until the pinning changes (``pin_prefix``, ``unpin``); the
        aliases live on this object only, so they go before the registration (``_unregister``) they read through."""
        from ktorch.ops.triton_gather import as_words, host_alias, word_dtype

        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device in self._gather_sources:
            return self._gather_sources[device]
        words = None
        if device.type == "cpu" or (device.type == "cuda" and self.pinned_experts == self.num_experts):
            words = []
            for t, src in zip(self.tensors, self.sources):
                if t is None:
                    words.append(None)
                    continue
                if not (t.is_contiguous() and src.is_contiguous()):
                    words = None
                    break
                dtype = word_dtype(t.element_size() * t[0].numel(), t.data_ptr(), src.data_ptr())
                w = as_words(src, dtype) if device.type == "cpu" else host_alias(src, dtype, device)
                if w is None:
                    words = None
                    break
                words.append(w)
        self._gather_sources[device] = None if words is None else tuple(words)
        return self._gather_sources[device]

    def prefix_bytes(self, n: int) -> int:
        """Bytes of experts [0, n) of every packed tensor, each range starting 256-byte aligned in one buffer."""
        return sum(_align(t[:n].numel() * t.element_size()) for t in self.tensors if t is not None)

    def views_in(self, buffer: torch.Tensor, n: int) -> tuple:
        """Experts [0, n) of (w13, w13_scales, w2, w2_scales) laid out one after another in the uint8 ``buffer``
        (``prefix_bytes(n)`` of it): where ``CopyAhead`` puts them on the device."""
        views, offset = [], 0
        for t in self.tensors:
            if t is None:
                views.append(None)
                continue
            nbytes = t[:n].numel() * t.element_size()
            views.append(buffer[offset:offset + nbytes].view(t.dtype).view(n, *t.shape[1:]))
            offset += _align(nbytes)
        return tuple(views)

    def copy_prefix(self, views: tuple, n: int) -> None:
        """Queues the copies of experts [0, n) into ``views`` (``views_in``) on the current stream."""
        for dst, src in zip(views, self.sources):
            if dst is not None:
                as_bytes(dst).copy_(as_bytes(src[:n]), non_blocking=True)

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, n: int) -> torch.Tensor:
        """The part of experts [0, n) in the layer's output: [T, H] in hidden's dtype on hidden's device."""
        w13, w2 = self.device_weights(n, hidden.device, hidden.dtype, tokens=hidden.shape[0])
        slots = torch.where((topk_ids >= 0) & (topk_ids < n), topk_ids, -1)
        return gpu_experts_forward(hidden, slots, topk_weights, w13, w2, self.activation, self.kernel)


def _align(nbytes: int, to: int = 256) -> int:
    return (nbytes + to - 1) // to * to


@dataclass
class _Pending:
    layer: StreamedExperts
    n: int
    views: tuple
    done: torch.cuda.Event
    captured: bool  # queued while the stream was capturing a CUDA graph


class CopyAhead:
    """The copies of the next layer's streamed experts, queued on a side stream while this layer computes.

    Without it a layer's copy starts when the device stream reaches the layer, and the copy engines idle through
    the layer's attention, router, dequantization and GEMMs; with it they copy layer i+1's experts from the
    moment layer i's own copy is taken (before its dequantization and GEMMs), so over a prompt they run back to
    back (the copy, not the layers' serial GPU work, sets the GPU side's pace; queued after the dequantization, the
    first device run found the copy engines idle through it: 12 layers x 2.2 ms at 512 tokens). Two device
    buffers of the largest layer's streamed bytes take turns: layer i reads one while layer i+1's copy fills the
    other. One per device and model
    (``link_streamed_layers``); a layer whose copy was not queued ahead (the first, or after a plan change)
    copies on the current stream, as without it.

    Under CUDA graph capture the side stream forks from the capturing stream and joins it at the next layer, so
    the copies are graph nodes with those dependencies; the last layer queues nothing, so no work is left on the
    side stream when a forward ends."""

    def __init__(self, device: torch.device, nbytes: int):
        if device.index is None:  # "cuda" -> "cuda:N", which is what tensors on it report
            device = torch.device(device.type, torch.cuda.current_device())
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.buffers = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
        self.last = 0  # the buffer the latest layer read
        self.pending: Optional[_Pending] = None

    def take(self, layer: StreamedExperts, n: int) -> tuple:
        """The device copies of ``layer``'s experts [0, n): the queued ones (the current stream waits for them) or
        copies queued now on the current stream."""
        current = torch.cuda.current_stream(self.device)
        capturing = torch.cuda.is_current_stream_capturing()
        pending, self.pending = self.pending, None
        if pending is not None:
            if pending.captured == capturing:
                current.wait_event(pending.done)  # (also when it is not for this layer: its buffer gets reused)
                if pending.layer is layer and pending.n == n:
                    return pending.views
            elif not capturing:
                pending.done.synchronize()  # queued in a capture that ended: nothing left to wait for in it
        self.last = 1 - self.last
        views = layer.views_in(self.buffers[self.last], n)
        layer.copy_prefix(views, n)
        return views

    def queue_next(self, layer: StreamedExperts, tokens: int) -> None:
        """After ``layer`` took its experts (before it reads them): queue the copy of the next layer's, for a call
        of ``tokens`` tokens."""
        nxt = layer.next_layer
        if nxt is None or nxt.plan is None or nxt.copy_ahead is not self:
            return
        n = min(nxt.plan.experts_for(tokens), nxt.pinned_experts)
        if n <= 0:
            return
        other = 1 - self.last  # last read by the previous layer, whose dequantization is queued before this point
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            views = nxt.views_in(self.buffers[other], n)
            nxt.copy_prefix(views, n)
            done = torch.cuda.Event()
            done.record(self.stream)
        self.last = other
        self.pending = _Pending(nxt, n, views, done, torch.cuda.is_current_stream_capturing())


def link_streamed_layers(layers: Sequence[StreamedExperts], device: torch.device) -> Optional[CopyAhead]:
    """Chains a model's streamed layers in forward order for ``CopyAhead`` on ``device`` (a CUDA device; layers
    with a plan and page-locked experts). Returns it, or None where nothing streams."""
    nbytes = max((s.prefix_bytes(s.pinned_experts) for s in layers if s.pinned_experts), default=0)
    if nbytes == 0 or device.type != "cuda":
        return None
    ahead = CopyAhead(device, nbytes)
    for s, nxt in zip(layers, list(layers[1:]) + [None]):
        s.copy_ahead, s.next_layer = ahead, nxt
    return ahead


_REGISTRY: list[StreamedExperts] = []


def register_streamed_experts(streamed: StreamedExperts) -> int:
    """Keeps ``streamed`` for the life of the process; returns the handle the op takes."""
    _REGISTRY.append(streamed)
    return len(_REGISTRY) - 1


def streamed_experts_of(handle: int) -> StreamedExperts:
    if not 0 <= handle < len(_REGISTRY):
        raise ValueError(f"streamed_experts: no streamed experts under handle {handle} (have {len(_REGISTRY)})")
    return _REGISTRY[handle]


@torch.library.custom_op("ktorch::streamed_experts", mutates_args=())
def streamed_experts(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, handle: int,
                     n: int) -> torch.Tensor:
    """hidden [T, H], topk_ids/topk_weights [T, K] on the device -> [T, H]: the routed output of experts [0, n) of
    the layer registered under ``handle``, computed on hidden's device (zeros where no slot picks them)."""
    return streamed_experts_of(handle).forward(hidden, topk_ids, topk_weights, n)


@streamed_experts.register_fake
def _(hidden, topk_ids, topk_weights, handle, n):
    return torch.empty_like(hidden)


def cpu_ids_without(topk_ids: torch.Tensor, n: int) -> torch.Tensor:
    """topk_ids with the slots of experts [0, n) set to -1: what the CPU op computes beside the streamed part."""
    return torch.where(topk_ids < n, -1, topk_ids)


# ---------------------------------------------------------------- timing copies


def queue_timed(fn, n: int, stream: torch.cuda.Stream) -> tuple:
    """``n`` calls of ``fn()`` (work queued on the current stream) queued on ``stream`` now; (begin, end) timing
    events around them. What the split's calibration and benchmarks/bench_host_bandwidth.py time."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        begin.record()
        for _ in range(n):
            fn()
        end.record()
    return begin, end
