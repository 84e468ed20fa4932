"""The zero-copy gather of chosen experts (ktorch/ops/triton_gather.py) and its use by the prefill split
(``routed_experts.gather_experts``).

On the CPU: the split's gather (``index_select``, or the Triton kernel under TRITON_INTERPRET=1) lands the same bytes
as the per-run copies it replaced, for every packed layout; the kernel equals ``index_select``. On a GPU: aliases of
page-locked host memory read its bytes in place, and the kernel reads through them. The split's device part on a
GPU, gather against DMA runs, is in tests/test_routed_experts.py.
"""

from __future__ import annotations

import pytest
import torch

from ktorch.ops.packed_weights import MXFP4_DTYPE
from ktorch.ops.routed_experts import DeviceStaging, _copy_expert_runs, gather_experts
from ktorch.ops.streamed_experts import StreamedExperts
from ktorch.ops.triton_gather import (BLOCK, as_words, copy_routed_rows, gather_rows, host_alias, interpreting, triton,
                                     word_dtype)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernel = pytest.mark.skipif(
    triton is None or not (torch.cuda.is_available() or interpreting()),
    reason="the Triton kernel runs on a CUDA GPU, or on the CPU under TRITON_INTERPRET=1 with Triton installed")


def _random(shape: tuple, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bytes as a contiguous tensor of ``dtype`` and ``shape`` (any bit pattern: NaNs too)."""
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * size), dtype=torch.uint8, generator=gen)
    return raw.view(dtype)


# packed layouts (w13, w13 scales, w2, w2 scales) of E experts, I = 64, H = 128, by format: codes [E, N/16, K/per,
# 16, per], scales as each format keeps them (GGUF exact formats at the file's size, two-level K-quant [E, 2, G, N])
def _layout(fmt: str, E: int) -> list:
    I2, H, I = 128, 128, 64
    code = {"bf16": (torch.bfloat16, 2), "int8": (torch.int8, 4), "q8_0": (torch.int8, 4), "int4": (torch.uint8, 8),
            "q4_k": (torch.uint8, 8), "mxfp4": (MXFP4_DTYPE, 8)}[fmt]
    dtype, per = code
    scales = {"bf16": lambda N, K: None,
              "int8": lambda N, K: ((E, N, 1), torch.float32),
              "int4": lambda N, K: ((E, N, K // 32), torch.float32),
              "mxfp4": lambda N, K: ((E, N, K // 32), torch.float32),
              "q8_0": lambda N, K: ((E, K // 32, N), torch.float16),
              "q4_k": lambda N, K: ((E, 2, K // 32 + K // 64, N), torch.uint8)}[fmt]
    out = []
    for N, K in ((I2, H), (H, I)):
        out.append(((E, N // 16, K // per, 16, per), dtype))
        out.append(scales(N, K))
    return out


FORMATS = ["bf16", "int8", "int4", "mxfp4", "q8_0", "q4_k"]


def _random_layer(fmt: str, E: int = 9, seed: int = 0) -> StreamedExperts:
    gen = torch.Generator().manual_seed(seed)
    tensors = [None if spec is None else _random(*spec, gen) for spec in _layout(fmt, E)]
    return StreamedExperts(*tensors, "silu")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """[n, ...] of any dtype -> its bytes [n, row bytes]."""
    return as_words(t.contiguous(), torch.uint8)


def test_word_dtype_and_as_words():
    assert word_dtype(6144, 4096, 256) == torch.int64
    assert word_dtype(6144, 4100) == torch.int32  # an address 4-aligned only
    assert word_dtype(6, 0) == torch.int16 and word_dtype(7, 0) == torch.uint8
    t = torch.arange(24, dtype=torch.float32).reshape(3, 2, 4)
    w = as_words(t, torch.int64)
    assert w.shape == (3, 4) and w.data_ptr() == t.data_ptr()
    assert torch.equal(w.view(torch.float32).view(3, 2, 4), t)
    assert as_words(torch.empty(0, 5, dtype=torch.int16), torch.int16).shape == (0, 5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_gather_lands_the_run_copies_bytes(fmt):
    """For random chosen sets (none, one, runs of one, a few runs, many, all): ``gather_experts`` (the split's copy:
    index_select here, the kernel under TRITON_INTERPRET=1) puts exactly the bytes the per-run copies put in the
    staging's views, and those are the chosen experts' packed bytes; every packed layout is moved as bytes."""
    E = 9
    layer = _random_layer(fmt, E)
    gather, runs = (DeviceStaging(layer, E, torch.device("cpu"), torch.float32) for _ in range(2))
    gen = torch.Generator().manual_seed(1)
    sets = [[], [4], [0, 2, 4, 6, 8], [1, 2, 3, 6, 7], list(range(E)), [8]]
    sets += [sorted(torch.randperm(E, generator=gen)[:n].tolist()) for n in (2, 5, 7)]
    for ids in sets:
        chosen = torch.tensor(ids, dtype=torch.int64)
        got = gather_experts(layer, gather, chosen, chosen)
        want = _copy_expert_runs(layer, runs, chosen, chosen)
        for g, w, t in zip(got, want, layer.tensors):
            assert (g is None) == (w is None) == (t is None)
            if t is not None:
                assert g.shape == w.shape == (len(ids),) + tuple(t.shape[1:]) and g.dtype == t.dtype
                assert torch.equal(_bytes(g), _bytes(w)), (fmt, ids)
                assert torch.equal(_bytes(g), _bytes(t)[chosen]), (fmt, ids)


def test_staging_views_are_made_once_per_count_and_layout():
    layer, other = _random_layer("int8", seed=0), _random_layer("int8", seed=1)
    staging = DeviceStaging(layer, 9, torch.device("cpu"), torch.float32)
    words = layer.gather_sources(torch.device("cpu"))
    views, dsts = staging.views_for(layer, 3, words)
    assert staging.views_for(other, 3, other.gather_sources(torch.device("cpu")))[0] is views  # the same layout
    for v, w, d in zip(views, layer.views_in(staging.packed, 3), dsts):
        assert v.shape == w.shape and v.data_ptr() == w.data_ptr() == d.data_ptr() and d.shape[0] == 3
    assert staging.views_for(layer, 4, words)[0][0].shape[0] == 4


def test_cpu_gather_sources_are_word_views_of_the_tensors():
    layer = _random_layer("q4_k")
    words = layer.gather_sources(torch.device("cpu"))
    assert words is layer.gather_sources("cpu")  # cached
    for w, t in zip(words, layer.tensors):
        assert w.data_ptr() == t.data_ptr() and w.shape[0] == t.shape[0] and w.dim() == 2
    strided = StreamedExperts(layer.tensors[0].transpose(1, 2), None, layer.tensors[2], None, "silu")
    assert strided.gather_sources("cpu") is None  # not contiguous: the split copies in runs


@needs_kernel
@pytest.mark.parametrize("widths", [(3000, 5, 0, 7), (1, BLOCK, BLOCK + 1, 2 * BLOCK - 3)])
def test_kernel_equals_index_select(widths):
    """One launch over up to four pairs of word tensors (int64, int32, int16, uint8; one pair left out), rows wider
    than a program's block and narrower, ids repeated and out of order: each destination is index_select's."""
    gen = torch.Generator().manual_seed(2)
    E = 11
    ids = torch.tensor([10, 3, 3, 0, 7], dtype=torch.int64)
    dtypes = (torch.int64, torch.int32, torch.int16, torch.uint8)
    srcs = [None if W == 0 else _random((E, W), dt, gen).to(KERNEL_DEVICE) for W, dt in zip(widths, dtypes)]
    dsts = [None if s is None else torch.zeros(len(ids), s.shape[1], dtype=s.dtype, device=KERNEL_DEVICE)
            for s in srcs]
    ids = ids.to(KERNEL_DEVICE)
    gather_rows(dsts, srcs, ids)
    for d, s in zip(dsts, srcs):
        if s is not None:
            assert torch.equal(d, torch.index_select(s, 0, ids))
    gather_rows([None if d is None else d[:0] for d in dsts], srcs, ids[:0].to(torch.int32))  # nothing: returns
    # negative ids (a device-made choice padded to the staging's rows): those rows are left as they were
    padded = torch.tensor([4, -1, 9, -1], dtype=torch.int64, device=KERNEL_DEVICE)
    marks = [None if s is None else torch.full((4, s.shape[1]), 7, dtype=s.dtype, device=KERNEL_DEVICE)
             for s in srcs]
    gather_rows(marks, srcs, padded)
    for d, s in zip(marks, srcs):
        if s is not None:
            assert torch.equal(d[0], s[4]) and torch.equal(d[2], s[9]) and (d[1] == 7).all() and (d[3] == 7).all()


@needs_kernel
@pytest.mark.parametrize("dtype,W,K", [(torch.int64, 512, 8), (torch.int16, 1500, 3), (torch.uint8, 7, 1)])
def test_copy_routed_rows_moves_only_routed_tokens(dtype, W, K):
    """A captured prefill's CPU call moves the rows of tokens with a slot routed to the CPU (any id >= 0): those
    rows equal the source's; the others are left as they were (zero_others False: the call's pinned input) or zeroed
    (True: its result brought back), whatever bytes they held (NaN patterns too); rows wider and narrower than a
    program's block."""
    gen = torch.Generator().manual_seed(5)
    T = 37
    ids = torch.randint(0, 16, (T, K), generator=gen)
    ids[torch.rand(T, K, generator=gen) < 0.7] = -1  # most slots elsewhere (resident, copied)
    ids[[0, 5, 6]] = -1  # tokens with nothing on the CPU
    ids[9] = torch.arange(K)  # every slot on it
    live = (ids >= 0).any(1)
    assert 0 < int(live.sum()) < T
    src = _random((T, W), dtype, gen)
    before = _random((T, W), dtype, gen)
    ids = ids.to(torch.int32).to(KERNEL_DEVICE)
    for zero in (False, True):
        dst = before.clone().to(KERNEL_DEVICE)
        copy_routed_rows(dst, src.to(KERNEL_DEVICE), ids, zero_others=zero)
        dst = dst.cpu()
        assert torch.equal(dst[live], src[live])
        assert torch.equal(dst[~live], torch.zeros_like(before[~live]) if zero else before[~live])


def test_copy_routed_rows_checks_its_arguments():
    ids = torch.zeros(4, 2, dtype=torch.int64)
    a = torch.zeros(4, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"topk_ids must be a \[T, K\] int32 or int64"):
        copy_routed_rows(a, a.clone(), ids.float(), False)
    with pytest.raises(ValueError, match=r"dst must be a contiguous \[T=4, W\]"):
        copy_routed_rows(torch.zeros(3, 8, dtype=torch.int32), a, ids, False)
    with pytest.raises(ValueError, match=r"src must be a contiguous \[T=4, W\]"):
        copy_routed_rows(a, torch.zeros(8, 4, dtype=torch.int32).t(), ids, False)
    with pytest.raises(ValueError, match="dst and src must match"):
        copy_routed_rows(a, torch.zeros(4, 8, dtype=torch.int64), ids, False)


def test_gather_rows_checks_its_arguments():
    a = torch.zeros(4, 8, dtype=torch.int32)
    ids = torch.tensor([0, 1])
    out = torch.zeros(2, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="dsts and srcs must be sequences of one length"):
        gather_rows([out], [a, a], ids)
    with pytest.raises(ValueError, match="ids must be a 1-d int64 or int32"):
        gather_rows([out], [a], ids.float())
    with pytest.raises(ValueError, match=r"dsts\[0\] and srcs\[0\] must both be 2-d"):
        gather_rows([out], [None], ids)
    with pytest.raises(ValueError, match=r"dsts\[0\] must be \[k=2, W\]"):
        gather_rows([torch.zeros(3, 8, dtype=torch.int32)], [a], ids)
    with pytest.raises(ValueError, match=r"dsts\[0\] must be \[k=2, W\]"):
        gather_rows([out.view(torch.int16)], [a], ids)
    with pytest.raises(ValueError, match=r"dsts\[0\] and srcs\[0\] must be contiguous"):
        gather_rows([torch.zeros(8, 2, dtype=torch.int32).t()], [torch.zeros(8, 4, dtype=torch.int32).t()], ids)


# ---------------------------------------------------------------- on a GPU


@needs_cuda
def test_cuda_alias_of_registered_and_pinned_memory_reads_the_host_bytes():
    """A registered (cudaHostRegister, default flags) and a pin_memory() tensor: the alias is a CUDA tensor at the
    host address (no copy), device kernels read the host's bytes through it, including bytes written after it was
    made; memory not page-locked gets no alias."""
    gen = torch.Generator().manual_seed(3)
    host = _random((64, 1 << 20), torch.uint8, gen)  # 64 MiB: its own mmap, registered in place
    pinned = _random((16, 4096), torch.uint8, gen).pin_memory()
    cudart = torch.cuda.cudart()
    assert int(cudart.cudaHostRegister(host.data_ptr(), host.numel(), 0)) == 0
    try:
        for t in (host, pinned):
            alias = host_alias(t, torch.int64, torch.device("cuda"))
            assert alias is not None and alias.is_cuda and alias.data_ptr() == t.data_ptr()
            assert alias.shape == (t.shape[0], t.shape[1] // 8) and alias.dtype == torch.int64
            assert torch.equal((alias + 0).cpu(), as_words(t, torch.int64))  # read by a device kernel
            t[3].fill_(7)
            assert torch.equal((alias[3] + 0).cpu(), torch.full((t.shape[1] // 8,), 0x0707070707070707))
            del alias
        torch.cuda.synchronize()
    finally:
        assert int(cudart.cudaHostUnregister(host.data_ptr())) == 0
    assert host_alias(torch.zeros(4, 64, dtype=torch.uint8), torch.int64, torch.device("cuda")) is None


@needs_cuda
def test_cuda_kernel_gathers_through_aliases_and_the_layer_caches_them():
    """The split's sources on CUDA: aliases of the page-locked copies, made once, dropped by unpin (before the
    registration goes) and made again by the next pin; the kernel reads the chosen rows through them."""
    layer = _random_layer("q4_k", E=9)
    device = torch.device("cuda")
    assert layer.gather_sources(device) is None  # nothing page-locked yet
    layer.pin_prefix(9)
    words = layer.gather_sources(device)
    assert words is not None and words is layer.gather_sources("cuda")
    for w, src in zip(words, layer.sources):
        assert w.is_cuda and w.data_ptr() == src.data_ptr()
    ids = torch.tensor([8, 0, 5], device=device)
    dsts = [torch.empty(3, w.shape[1], dtype=w.dtype, device=device) for w in words]
    gather_rows(dsts, words, ids)
    for d, t in zip(dsts, layer.tensors):
        assert torch.equal(d.cpu().view(torch.uint8), _bytes(t)[[8, 0, 5]])
    layer.unpin()
    assert layer._gather_sources == {}
    layer.pin_prefix(9)
    assert layer.gather_sources(device) is not None and layer.gather_sources(device) is not words
