"""The chosen experts' packed bytes gathered from page-locked host memory in one Triton launch (zero-copy).

    dst_i[j, :] = src_i[ids[j], :]          j = 0..k-1, i = 0..3 (w13, w13_scales, w2, w2_scales)

The routing-aware split (ktorch/ops/routed_experts.py) moves the experts a call chose from the layer's packed host
tensors into the device staging. One ``copy_`` per contiguous run of ids and packed tensor cost ~80 copies and ~180
slices a layer on the launching thread (device, H200 host, 48-layer Qwen3-30B-A3B-shaped Q8_0 file, 512-token
prompt, ``--gpu-memory off``: ~490 top-level ATen ops a layer at ~16 us, the prefill bound by that thread). Here the
GPU's SMs read the host bytes themselves, over the bus, through a CUDA alias of the page-locked memory
(``host_alias``), one launch for all four tensors whatever the runs.

Layout: each source ``[E, W_i]`` and destination ``[k, W_i]`` hold one expert's packed bytes a row as W_i words of
1, 2, 4 or 8 bytes (``word_dtype``: the widest whose size divides the row's bytes and the addresses), rows
contiguous; ``ids`` [k] int64 (or int32) expert ids on the destinations' device. Programs: (chunk, j), a chunk
``BLOCK`` words of one tensor's row (the four tensors' chunks numbered one after another along axis 0); a copy, so
the destination holds the source's exact bits. Nothing is read from rows not in ``ids``.

Limits: ids in [0, E) (not checked on the device: an id out of range reads past the source), or negative: that
destination row is skipped (``routed_experts.choose_on_device``'s choice, padded with -1 to the staging's rows); k <= 65535 (grid axis
1); CUDA tensors (sources: aliases of page-locked host memory or device memory), or CPU tensors under Triton's
interpreter (TRITON_INTERPRET=1, for tests). Triton is imported if present, so this module imports anywhere and
``gather_rows`` fails on use with a clear error.

``copy_routed_rows`` is the same zero-copy access for a captured prefill's CPU experts call (ktorch/compile/
experts_runtime.py): only the rows of tokens with a slot routed to the CPU cross the bus, the hidden states to the
call's pinned input and its result back, where a copy of the whole [T, H] moved 8 MB each way at T = 2048 for the
~12% of the rows a skewed split leaves the CPU (session 57, H200 host: 0.16 + 0.35 ms a layer of the stream's time).

Aliases (``host_alias``): on a system with unified virtual addressing, memory page-locked with ``cudaHostAlloc``
(torch's ``pin_memory()``) or with ``cudaHostRegister(ptr, n, cudaHostRegisterDefault)`` is mapped into the
device's address space at the same address, so a CUDA tensor made on that pointer (``torch.as_tensor`` of an object
with ``__cuda_array_interface__``; torch's from_blob finds its device with ``cudaPointerGetAttributes``, which
accepts registered host memory and refuses unregistered) reads the host bytes from kernels. The alias keeps its
host tensor alive, but not the registration: an alias must not outlive the registration of its memory (ktorch's
are cached on the ``StreamedExperts`` that registered it and dropped with it or by its ``unpin``).
"""

import math
from typing import Optional, Sequence

import torch  # no "from __future__ import annotations": Triton reads the tl.constexpr annotations

from ktorch.ops.triton_experts import cdiv, interpreting, kernel_runs_on, triton, triton_available  # noqa: F401

MAX_TENSORS = 4  # w13, w13_scales, w2, w2_scales
BLOCK = 2048  # words a program (16 KiB of int64 words): 8 words a thread at 8 warps, loads of 16 bytes
NUM_WARPS = 8
_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_TYPESTR = {torch.int64: "<i8", torch.int32: "<i4", torch.int16: "<i2", torch.uint8: "|u1"}


def word_dtype(row_bytes: int, *addresses: int) -> torch.dtype:
    """The widest word (int64, int32, int16 or uint8) whose size divides ``row_bytes`` and every address."""
    for size, dtype in _WORDS.items():
        if row_bytes % size == 0 and all(a % size == 0 for a in addresses):
            return dtype
    raise AssertionError("unreachable: 1 divides everything")


def as_words(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous ``t`` [n, ...] of any dtype as [n, W] words of ``dtype`` (the same memory)."""
    n = t.shape[0]
    row_bytes = t.element_size() * math.prod(t.shape[1:])
    return t.view(torch.uint8).view(n, row_bytes).view(dtype)


class _CudaArray:
    """The minimum of the CUDA Array Interface (version 3) torch reads: a typed, shaped, contiguous device pointer.
    Holds ``owner`` (the host tensor) for as long as a tensor made on it lives (from_blob's deleter holds this)."""

    def __init__(self, ptr: int, shape: tuple, dtype: torch.dtype, owner: torch.Tensor):
        self.owner = owner
        self.__cuda_array_interface__ = {"version": 3, "typestr": _TYPESTR[dtype], "shape": tuple(shape),
                                         "strides": None, "data": (ptr, False)}


def host_alias(t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> Optional[torch.Tensor]:
    """A CUDA tensor on ``device`` reading the page-locked host tensor ``t`` [n, ...] (contiguous) as [n, W] words
    of ``dtype`` in place: no copy. None where torch places the pointer on another device (memory registered with
    another device current), or where it is not mapped (not page-locked: torch refuses the pointer). The caller keeps
    the registration alive for as long as the alias (see the module's docstring)."""
    # is_pinned: page-locked (cudaHostAlloc'd or registered), asked of the driver (cudaPointerGetAttributes)
    if not t.is_contiguous() or t.device.type != "cpu" or not t.is_pinned():
        return None
    device = torch.device(device)
    if device.index is None:  # "cuda" -> "cuda:N", what the alias reports
        device = torch.device(device.type, torch.cuda.current_device())
    words = as_words(t, dtype)
    if words.numel() == 0:
        return None
    try:
        # "cuda" without an index: torch asks the driver which device the pointer is on (recent torch takes an
        # explicit index as given, unchecked)
        with torch.cuda.device(device):
            alias = torch.as_tensor(_CudaArray(t.data_ptr(), words.shape, dtype, t), device="cuda")
    except (RuntimeError, TypeError, ValueError):  # e.g. "resides on host memory and is not registered"
        return None
    if alias.data_ptr() != t.data_ptr() or alias.device != device:  # moved: a copy, not an alias
        return None
    return alias


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _copy_chunk(src, dst, e, j, chunk, W, BLOCK: tl.constexpr):
        offs = chunk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = offs < W
        words = tl.load(src + e * W + offs, mask=live)
        tl.store(dst + j * W + offs, words, mask=live)

    @triton.jit
    def _gather_rows(ids, s0, d0, w0, s1, d1, w1, s2, d2, w2, s3, d3, w3, end0, end1, end2,
                     BLOCK: tl.constexpr):
        # axis 0: the chunks of tensor 0's row, then tensor 1's, ... (end_i: the chunks before tensor i + 1's)
        pid = tl.program_id(0)
        j = tl.program_id(1).to(tl.int64)
        e = tl.load(ids + j).to(tl.int64)
        if e >= 0:  # a negative id: the row is left as it is (a device-made choice padded to the staging's rows)
            if pid < end0:
                _copy_chunk(s0, d0, e, j, pid, w0, BLOCK)
            elif pid < end1:
                _copy_chunk(s1, d1, e, j, pid - end0, w1, BLOCK)
            elif pid < end2:
                _copy_chunk(s2, d2, e, j, pid - end1, w2, BLOCK)
            else:
                _copy_chunk(s3, d3, e, j, pid - end2, w3, BLOCK)


if triton is not None:

    @triton.jit
    def _copy_routed_rows(src, dst, ids, W, K, ZERO: tl.constexpr, FENCE: tl.constexpr, KP: tl.constexpr,
                          BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        slots = tl.arange(0, KP)
        row = tl.load(ids + t * K + slots, mask=slots < K, other=-1)
        live = tl.max((row >= 0).to(tl.int32), axis=0) > 0
        offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < W
        if live:
            tl.store(dst + t * W + offs, tl.load(src + t * W + offs, mask=inside), mask=inside)
            if FENCE:  # written to host memory (a call's input): seen before the doorbell a later kernel rings
                tl.inline_asm_elementwise("membar.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                                          pack=1)
        elif ZERO:
            tl.store(dst + t * W + offs, tl.zeros([BLOCK], dtype=dst.dtype.element_ty), mask=inside)


def copy_routed_rows(dst: torch.Tensor, src: torch.Tensor, topk_ids: torch.Tensor, zero_others: bool) -> None:
    """``dst[t] = src[t]`` for every row t of a token with a routed slot (``topk_ids[t, j] >= 0`` for some j); the
    other rows of ``dst`` are zeroed where ``zero_others``, else left as they are. dst and src [T, W] word tensors of
    one dtype (``as_words``; either may alias page-locked host memory, ``host_alias``), topk_ids [T, K] int32/int64
    contiguous, all on one device where Triton runs. One launch on the current stream, nothing read from the rows
    left out. Raises ValueError naming the argument otherwise."""
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32,
                                                                                                torch.int64):
        raise ValueError("copy_routed_rows: topk_ids must be a [T, K] int32 or int64 tensor, got "
                         + (f"{topk_ids.dtype} {tuple(topk_ids.shape)}" if isinstance(topk_ids, torch.Tensor)
                            else type(topk_ids).__name__))
    T, K = topk_ids.shape
    for name, t in (("dst", dst), ("src", src)):
        if t.dim() != 2 or t.shape[0] != T or not t.is_contiguous() or t.device != topk_ids.device:
            raise ValueError(f"copy_routed_rows: {name} must be a contiguous [T={T}, W] tensor on {topk_ids.device}, "
                             f"got {tuple(t.shape)} on {t.device}")
    if dst.dtype != src.dtype or dst.shape != src.shape:
        raise ValueError(f"copy_routed_rows: dst and src must match, got {dst.dtype} {tuple(dst.shape)} and "
                         f"{src.dtype} {tuple(src.shape)}")
    if not topk_ids.is_contiguous():
        raise ValueError("copy_routed_rows: topk_ids must be contiguous")
    if triton is None:
        raise RuntimeError("copy_routed_rows: Triton is not installed")
    if not kernel_runs_on(topk_ids):
        raise ValueError(f"copy_routed_rows: the Triton kernel runs on CUDA tensors (CPU ones only under Triton's "
                         f"interpreter, TRITON_INTERPRET=1), topk_ids are on {topk_ids.device}")
    W = dst.shape[1]
    if T == 0 or W == 0:
        return
    block = min(1024, 1 << (W - 1).bit_length())
    kp = 1 << (K - 1).bit_length() if K else 1  # the slots padded to a power of two
    fence = not interpreting()  # dst may be host memory: its rows ordered before a doorbell a later kernel rings
    _copy_routed_rows[(T, cdiv(W, block))](src, dst, topk_ids, W, K, ZERO=bool(zero_others), FENCE=fence, KP=kp,
                                           BLOCK=block, num_warps=4)


def gather_rows(dsts: Sequence[Optional[torch.Tensor]], srcs: Sequence[Optional[torch.Tensor]],
                ids: torch.Tensor) -> None:
    """dsts[i] [k, W_i] and srcs[i] [E_i, W_i] word tensors (None pairs skipped; up to 4 pairs), ids [k] int64 or
    int32 on the destinations' device: ``dsts[i][j] = srcs[i][ids[j]]`` for every pair, in one launch on the current
    stream. Rows contiguous; each pair of one word dtype. Raises ValueError naming the argument otherwise."""
    if len(dsts) != len(srcs) or not 1 <= len(dsts) <= MAX_TENSORS:
        raise ValueError(f"gather_rows: dsts and srcs must be sequences of one length in 1..{MAX_TENSORS}, got "
                         f"{len(dsts)} and {len(srcs)}")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype not in (torch.int64, torch.int32):
        got = (ids.dtype, tuple(ids.shape)) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"gather_rows: ids must be a 1-d int64 or int32 tensor, got {got}")
    k = ids.numel()
    pairs = []
    for i, (dst, src) in enumerate(zip(dsts, srcs)):
        if dst is None and src is None:
            continue
        if dst is None or src is None or dst.dim() != 2 or src.dim() != 2:
            raise ValueError(f"gather_rows: dsts[{i}] and srcs[{i}] must both be 2-d [rows, W] word tensors, got "
                             f"{None if dst is None else tuple(dst.shape)} and "
                             f"{None if src is None else tuple(src.shape)}")
        if dst.dtype != src.dtype or dst.shape[1] != src.shape[1] or dst.shape[0] != k:
            raise ValueError(f"gather_rows: dsts[{i}] must be [k={k}, W] of srcs[{i}]'s W and dtype, got "
                             f"{dst.dtype} {tuple(dst.shape)} for {src.dtype} {tuple(src.shape)}")
        if not (dst.is_contiguous() and src.is_contiguous()):
            raise ValueError(f"gather_rows: dsts[{i}] and srcs[{i}] must be contiguous")
        if dst.device != ids.device or src.device != ids.device:
            raise ValueError(f"gather_rows: dsts[{i}] ({dst.device}), srcs[{i}] ({src.device}) and ids "
                             f"({ids.device}) must be on one device")
        pairs.append((src, dst))
    if not pairs or k == 0:
        return
    if k > 65535:
        raise ValueError(f"gather_rows: at most 65535 rows (grid axis 1), got {k}")
    if triton is None:
        raise RuntimeError("gather_rows: Triton is not installed")
    if not kernel_runs_on(ids):
        raise ValueError(f"gather_rows: the Triton kernel runs on CUDA tensors (CPU ones only under Triton's "
                         f"interpreter, TRITON_INTERPRET=1), ids are on {ids.device}")
    args, ends, total = [], [], 0
    for src, dst in pairs:
        W = src.shape[1]
        args += [src, dst, W]
        total += cdiv(W, BLOCK)
        ends.append(total)
    while len(ends) < MAX_TENSORS:  # unused slots: no chunks (any pointer of a used pair's type)
        args += [pairs[0][0], pairs[0][1], 1]
        ends.append(total)
    _gather_rows[(total, k)](ids, *args, *ends[:MAX_TENSORS - 1], BLOCK=BLOCK, num_warps=NUM_WARPS)
